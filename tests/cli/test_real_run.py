"""``fusedpar train`` on a user's inputs and through faults: a Hugging Face model folder and a
token file or saved dataset (the ranks' part on the warm pools, against one process), NaN
losses, a rank SIGKILLed in the middle of a step (the launcher's report, keep-K), and a run
under ``torchrun --max-restarts 1`` killed while writing a checkpoint, resumed from the older
one with the uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fusedpar.cli import build_parser, launch, main, train
from tests.cli.common import ROOT

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

VOCAB, STEPS = 64, 6
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A saved tiny Llama (config and weights), a Qwen2 config alone, a uint16 token file
    (ids with a learnable pattern) and the same tokens as a saved dataset of uneven rows."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(root / "llama")
    transformers.Qwen2Config(**TINY).save_pretrained(root / "qwen2")
    tokens = (np.arange(4096) * 7 + np.arange(4096) // 50) % VOCAB
    tokens.astype(np.uint16).tofile(root / "tokens.bin")
    cuts = np.cumsum([13, 40, 7, 99] * 30)
    rows = [r.tolist() for r in np.split(tokens, cuts[cuts < len(tokens)]) if len(r)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / "dataset"))
    return root


def _spec(argv: list[str], world: int) -> dict:
    args = build_parser().parse_args(["train", "--no-compare", *argv])
    pcfg, tcfg, _ = train.resolve(args, world)
    return train.run_spec(args, pcfg, tcfg, train.resume_path(args.resume, args.save)[0])


@contextlib.contextmanager
def _after_forward(hook):
    """Inside: the models ``train.parallel_model`` builds pass their output through
    ``hook(n, output)`` after their n-th forward (1-based)."""
    build = train.parallel_model

    def hooked(*args, **kwargs):
        model = build(*args, **kwargs)
        calls = []

        def forward_hook(module, args, output):
            calls.append(1)
            return hook(len(calls), output)

        model.register_forward_hook(forward_hook)
        return model

    train.parallel_model = hooked
    try:
        yield
    finally:
        train.parallel_model = build


def _train(spec: dict, compare: bool = False, nan_at: int | None = None):
    """``train_rank`` on this pool rank (reference backends: fast), the single-process run
    on rank 0 when ``compare``; ``nan_at``: the model's loss is NaN at that step (1-based).
    A raised error comes back as its message."""
    import torch.distributed as dist

    from tests.parallel.parallel_cases import reference_backends

    def poison(n, output):
        if n == nan_at:
            output.loss = output.loss * float("nan")
        return output

    torch.set_num_threads(1)
    try:
        with reference_backends(), _after_forward(poison):
            return train.train_rank(dist.group.WORLD, torch.device("cpu"), {**spec, "compare": compare})
    except FloatingPointError as e:
        return str(e)


def _argv(inputs, model="llama", data="tokens.bin") -> list[str]:
    return ["--model", str(inputs / model), "--data", str(inputs / data), "--steps", str(STEPS),
            "--batch-size", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def uninterrupted(pools, inputs):
    """The Llama folder's weights on the token file at 4 ranks (tp=2 x dp_shard=2) and at 2
    (dp_shard=2): rank 0's records, with the single-process losses."""
    return {4: pools(4).run(_train, _spec(_argv(inputs), 4), True, timeout=300)[0],
            2: pools(2).run(_train, _spec([*_argv(inputs), "--tp", "1"], 2), True, timeout=300)[0]}


@pytest.mark.timeout(600)
def test_model_folder_and_data_train_like_one_process_at_2_and_4_ranks(pools, inputs, uninterrupted):
    """The same global batches at any world size: 4 ranks (tp2 x dp2) and 2 ranks (dp2) both
    give the single process's curve; a Qwen2 config without weights (seeded init) on the
    saved dataset (the token file's tokens in uneven rows, packed) too."""
    four, two = uninterrupted[4], uninterrupted[2]
    assert train.max_rel_diff(four["losses"], four["reference_losses"]) <= 1e-5, four
    assert four["losses"][-1] < four["losses"][0]  # the pattern is learnable
    assert two["reference_losses"] == four["reference_losses"]
    assert train.max_rel_diff(two["losses"], four["reference_losses"]) <= 1e-5, (two, four)
    packed = pools(2).run(_train, _spec(_argv(inputs, "qwen2", "dataset"), 2), True, timeout=300)[0]
    assert train.max_rel_diff(packed["losses"], packed["reference_losses"]) <= 1e-5, packed
    assert packed["losses"][0] != four["losses"][0]  # its own seeded weights, not Llama's


@pytest.mark.timeout(300)
def test_async_saves_keep_the_newest_and_change_no_loss(pools, inputs, uninterrupted, tmp_path):
    spec = _spec([*_argv(inputs), "--tp", "1", "--save", str(tmp_path), "--save-every", "2",
                  "--keep", "2", "--async-save"], 2)
    record = pools(2).run(_train, spec, timeout=200)[0]
    assert record["losses"] == uninterrupted[2]["losses"]
    assert record["saved"] == [str(tmp_path / f"step-{n}") for n in (2, 4, 6)]
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-6"]


@pytest.mark.timeout(300)
def test_a_nan_loss_stops_the_run_or_is_skipped(pools, inputs):
    spec = _spec(_argv(inputs), 2)
    stopped = pools(2).run(_train, spec, nan_at=3, timeout=200)
    assert [m.split(": the loss")[0] for m in stopped] == ["step 3, rank 0", "step 3, rank 1"], stopped
    assert "the loss is nan" in stopped[0] and "--on-nonfinite skip" in stopped[0]
    skipped = pools(2).run(_train, {**spec, "on_nonfinite": "skip"}, nan_at=3, timeout=200)[0]
    losses = skipped["losses"]
    assert skipped["skipped"] == [3] and math.isnan(losses[2]), skipped
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != 2), losses
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("argv, message", [
    (["--data", "{tokens}", "--model", "{root}/llama", "--batch-size", "400", "--seq-len", "16"],
     "4,096 tokens, too few for one batch of 400 x 16 = 6,400 tokens"),
    (["--data", "{root}/big.bin"], "token id 999 is outside the model's vocabulary of 64"),
    (["--model", "{root}/gpt_neox"], "is not a supported model"),
    (["--model", "{root}"], "no config.json there"),
    (["--save", "/proc/fusedpar"], "--save /proc/fusedpar: cannot write there"),
])
def test_bad_inputs_are_refused_before_training(inputs, capsys, argv, message):
    if not (inputs / "big.bin").exists():
        np.full(8192, 999, dtype=np.uint16).tofile(inputs / "big.bin")
        transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, intermediate_size=64).save_pretrained(
            inputs / "gpt_neox")
    argv = [a.format(root=inputs, tokens=inputs / "tokens.bin") for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(inputs / "llama")]
    start = time.monotonic()
    assert main(["train", "--no-compare", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert time.monotonic() - start < 30  # no rank was started


def _killed_mid_step(group, device, spec):
    """``train_rank``; rank 1 SIGKILLs itself after the forward of step 4 (before its
    backward), noting the time in ``spec["killed_at"]``."""
    import torch.distributed as dist

    def kill(n, output):
        if n == 4 and dist.get_rank() == 1:
            with open(spec["killed_at"], "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return output

    with _after_forward(kill):
        return train.train_rank(group, device, spec)


@pytest.mark.timeout(300)
def test_sigkill_mid_step_is_reported_first_and_keeps_two_checkpoints(inputs, tmp_path, monkeypatch):
    """Saved after every step with --keep 2, rank 1 killed in step 4: the report's first line
    names rank 1 and SIGKILL, the others are stopped at once (within FUSEDPAR_TIMEOUT + 10 s),
    and the two newest checkpoints (steps 2 and 3) are all that is left."""
    monkeypatch.setenv("FUSEDPAR_BACKEND", "reference")
    monkeypatch.setenv("FUSEDPAR_TIMEOUT", "20")
    spec = _spec([*_argv(inputs), "--save", str(tmp_path / "run"), "--save-every", "1",
                  "--keep", "2"], 4)
    spec["killed_at"] = str(tmp_path / "killed_at")
    result, error = launch.spawn(_killed_mid_step, spec, 4, "cpu", 200, "killtest", interpret=False)
    stopped = time.time()
    assert result is None
    first = error.splitlines()[0]
    assert first == "a rank failed: rank 1 was killed by SIGKILL (exit status -9)", error
    assert "Traceback" not in error, error  # the survivors' lost connections: one line at most
    assert sum("then lost" in line for line in error.splitlines()) <= 1, error
    assert stopped - float((tmp_path / "killed_at").read_text()) < 20 + 10, error
    assert sorted(os.listdir(tmp_path / "run")) == ["step-2", "step-3"]


_TORCHRUN_SCRIPT = '''
import os, signal, sys
import torch.distributed.checkpoint as dcp
from fusedpar.cli import main

if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    write = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # rank 1's shards of step 4 written, no .metadata
        written = write(self, plan, planner)
        if "step-4" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    dcp.FileSystemWriter.write_data = write_then_die
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.timeout(400)
def test_torchrun_restart_resumes_from_the_older_checkpoint(inputs, tmp_path, uninterrupted):
    """torchrun --max-restarts 1 on 2 ranks (dp_shard=2), --save-every 2 --resume auto: rank 1
    is SIGKILLed while the
    checkpoint of step 4 is being written beside the complete one of step 2; the restart
    loads step 2 (never the partial folder) and its losses from step 3 on are the
    uninterrupted run's, bit for bit."""
    (tmp_path / "run.py").write_text(_TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p),
               FUSEDPAR_BACKEND="reference", OMP_NUM_THREADS="1")
    metrics = tmp_path / "metrics.json"
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "run.py", "train", *_argv(inputs), "--tp", "1", "--no-compare",
         "--save", str(tmp_path / "run"), "--save-every", "2", "--resume", "auto",
         # every wait bounded at 60 s: a survivor stuck in one for a dead peer costs at most that
         "--metrics", str(metrics), "--timeout", "60"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming from " + str(tmp_path / "run" / "step-2") in res.stdout, res.stdout
    m = json.loads(metrics.read_text())
    assert m["first_step"] == 2
    assert m["losses"] == uninterrupted[2]["losses"][2:], (m["losses"], uninterrupted[2]["losses"])
    assert sorted(os.listdir(tmp_path / "run")) == ["step-2", "step-4", "step-6"]


def test_a_full_disk_while_saving_names_the_step_and_the_checkpoint_kept(tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    model = train.build_model(train.TrainConfig(), "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    assert train.save_step(str(tmp_path), 2, model, optimizer, 0, "cpu", None)() == str(tmp_path / "step-2")

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    with pytest.raises(RuntimeError, match=r"saving step 4 into \S+/step-4 failed \(OSError: \[Errno 28\] "
                       r"No space left on device\); the newest complete checkpoint is \S+/step-2: "):
        train.save_step(str(tmp_path), 4, model, optimizer, 0, "cpu", None)
