"""fusedpar.integrations.hf: a tiny Hugging Face Qwen2 parallelized at tp=2 x dp_shard=2 on 4
CPU ranks, trained by ``FusedparTrainer`` and by a plain ``accelerate.Accelerator`` loop,
against the same loop in one process (this test's process) on the plain model."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers", reason="fusedpar[hf] extra: transformers not installed")
pytest.importorskip("accelerate", reason="fusedpar[hf] extra: accelerate not installed")

from tests.ops.collective_cases import cpu_row_scales, env  # noqa: E402
from tests.parallel.parallel_cases import make_model, reference_backends  # noqa: E402

pytestmark = pytest.mark.multirank

SEQ, ROWS, STEPS, GA, MICRO = 16, 40, 5, 2, 4  # MICRO: the global micro-batch (rows)
# float8's recipe here: every cast scales per token or per weight row (its weight gradient in
# high precision), so one process's batch of MICRO rows casts as each rank's row does
FLOAT8 = "rowwise_with_gw_hp"
PARALLEL = {"tp": 2, "dp_shard": 2}
TRAIN_ARGS = dict(max_steps=STEPS, gradient_accumulation_steps=GA, learning_rate=1e-2,
                  max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=3,
                  report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
                  lr_scheduler_type="linear", dataloader_num_workers=0)


class Rows(torch.utils.data.Dataset):
    """Rows of tokens whose labels ignore (-100) a different number of positions per row,
    so the accumulation window's token count differs from micro-batch to micro-batch."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(64, (ROWS, SEQ), generator=g)
        self.labels = self.ids.clone()
        for r in range(ROWS):
            self.labels[r, SEQ - 1 - r % 7:] = -100

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@contextlib.contextmanager
def accelerate_env(rank: int | None = None, world: int = 1):
    """The environment torchrun gives a rank (Accelerate reads it; none for one process),
    restored afterwards with Accelerate's shared state (the pool's ranks run other tests
    too, and each loop here starts from a fresh state)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    keys = {} if rank is None else {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world,
                                    "LOCAL_WORLD_SIZE": world}
    try:
        with env(**keys):
            yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def losses_of(trainer, after: int = 0) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after]


def trainer_losses(out: str, parallel: dict | None, resume_step: int | None = None, seed: int = 0,
                   float8: str | None = None, **args) -> list[tuple[float, float]]:
    """(loss, grad norm) of each step of a Trainer run (a FusedparTrainer when ``parallel``;
    ``float8``: the plain model converted by torchao as parallelize converts it)."""
    from transformers import Trainer, TrainingArguments

    import fusedpar
    from fusedpar.integrations.hf import FusedparTrainer

    model, cls, batch = make_model("hf-qwen2", seed=seed), Trainer, MICRO
    if float8 is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8),
                                   module_filter_fn=lambda m, name: name != "lm_head")
    if parallel is not None:
        model = fusedpar.parallelize(model, parallel, device_type="cpu")
        cls, batch = FusedparTrainer, MICRO // model.fusedpar_config.dp
    trainer = cls(model=model, train_dataset=Rows(),
                  args=TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                         **{**TRAIN_ARGS, **args}))
    resume = None if resume_step is None else os.path.join(out, f"checkpoint-{resume_step}")
    trainer.train(resume_from_checkpoint=resume)
    return losses_of(trainer, after=resume_step or 0)


def accelerate_losses(out: str, parallel: dict | None, resume: bool = False) -> list[float]:
    """Each micro-batch's loss of a plain Accelerator loop (gradient accumulation, clipping);
    saves a DCP checkpoint after optimizer step 3, or with ``resume`` starts from it (other
    initial weights)."""
    from accelerate import Accelerator

    import fusedpar
    from fusedpar.integrations.hf import prepare_accelerator
    from fusedpar.parallel import checkpoint

    model, batch = make_model("hf-qwen2", seed=5 if resume else 0), MICRO
    accelerator = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    if parallel is not None:
        model = fusedpar.parallelize(model, parallel, device_type="cpu")
        prepare_accelerator(accelerator, model)
        batch = MICRO // model.fusedpar_config.dp
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = 3 * GA if resume else 0
    if resume:
        checkpoint.load(out, model, optimizer)
        loader = accelerator.skip_first_batches(loader, first)
    losses = []
    for micro, inputs in enumerate(loader, first):
        with accelerator.accumulate(model):
            loss = model(**inputs).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), TRAIN_ARGS["max_grad_norm"])
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if micro + 1 == 3 * GA and not resume:
            checkpoint.save(out, model, optimizer)
    return losses


def generate_cases() -> list:
    """For an fsdp and a tp model (prepared for Accelerate): what ``generate()`` says, and
    the greedy tokens of ``unparallelized(model)`` (weights 0's)."""
    from accelerate import Accelerator

    import fusedpar
    from fusedpar.integrations.hf import prepare_accelerator, unparallelized

    prompt = Rows().ids[:2, :5]
    results = []
    for parallel in ({"dp_shard": 4}, PARALLEL):
        model = fusedpar.parallelize(make_model("hf-qwen2", seed=0), parallel, device_type="cpu")
        accelerator = Accelerator(cpu=True)
        model = prepare_accelerator(accelerator, model)
        try:
            model.generate(prompt, max_new_tokens=3)
            refusal = None
        except NotImplementedError as e:
            refusal = str(e)
        try:
            accelerator.save_state("unused")
            save_refusal = None
        except NotImplementedError as e:
            save_refusal = str(e)
        tokens = unparallelized(model).generate(prompt, max_new_tokens=3, do_sample=False)
        results.append((refusal, save_refusal, tokens.tolist()))
    return results


def bf16_without_param_dtype() -> str:
    """What bf16=True says for a model parallelized in float32."""
    from transformers import TrainingArguments

    import fusedpar
    from fusedpar.integrations.hf import FusedparTrainer

    model = fusedpar.parallelize(make_model("hf-qwen2"), PARALLEL, device_type="cpu")
    try:
        FusedparTrainer(model=model, train_dataset=Rows(), args=TrainingArguments(
            output_dir="unused", bf16=True, use_cpu=True, report_to="none"))
    except ValueError as e:
        return str(e)
    return "no error"


def _hf_cases(out: str):
    """The Trainer run, its resumption, the Accelerate loop and its resumption, on this rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    rank_world = (dist.get_rank(), dist.get_world_size())
    results = []
    for run in (lambda: trainer_losses(out, PARALLEL),
                lambda: trainer_losses(out, PARALLEL, resume_step=3, seed=5),
                lambda: accelerate_losses(out + "-dcp", PARALLEL),
                lambda: accelerate_losses(out + "-dcp", PARALLEL, resume=True),
                lambda: trainer_losses(out + "-bf16", {**PARALLEL, "param_dtype": "bfloat16"},
                                       bf16=True, max_steps=2),
                bf16_without_param_dtype,
                generate_cases,
                lambda: trainer_losses(out + "-fp8", {"dp_shard": 4, "float8": FLOAT8}, max_steps=2)
                if importlib.util.find_spec("torchao") else None):
        with reference_backends(), accelerate_env(*rank_world):
            results.append(run())
    return results


@cpu_row_scales
def test_trainer_and_accelerate_match_one_process_and_resume(pools, tmp_path):
    run, resumed, acc_run, acc_resumed, bf16, bf16_refusal, generated, fp8 = pools(4).run(
        _hf_cases, str(tmp_path / "parallel"), timeout=500)[0]
    with accelerate_env():
        single = trainer_losses(str(tmp_path / "single"), None)
    with accelerate_env():
        single_bf16 = trainer_losses(str(tmp_path / "single-bf16"), None, bf16=True, max_steps=2)
    with accelerate_env():
        acc_single = accelerate_losses(str(tmp_path / "single-dcp"), None)
    assert len(acc_run) == len(acc_single) == STEPS * GA
    for loss, ref in zip(acc_run, acc_single):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (acc_run, acc_single)
    assert acc_resumed == acc_run[3 * GA:]
    assert len(run) == len(single) == STEPS
    assert max(g for _, g in single) > TRAIN_ARGS["max_grad_norm"]  # clipping was active
    for (loss, norm), (ref_loss, ref_norm) in zip(run, single):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (run, single)
        assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (run, single)
    assert resumed == run[3:]
    # bf16=True: FSDP2's bf16 compute (param_dtype), close to one process's autocast
    assert bf16[0][0] != run[0][0]  # it did compute in bf16
    for (loss, _), (ref, _) in zip(bf16, single_bf16):
        assert abs(loss - ref) <= 2e-2 * abs(ref), (bf16, single_bf16)
    assert "param_dtype='bfloat16'" in bf16_refusal

    plain = make_model("hf-qwen2", seed=0).eval()
    expected = plain.generate(Rows().ids[:2, :5], max_new_tokens=3, do_sample=False).tolist()
    for refusal, save_refusal, tokens in generated:  # fsdp, then tp x fsdp
        assert "unparallelized(model)" in refusal and "full_state_dict" in refusal
        assert "fusedpar.parallel.checkpoint.save" in save_refusal
        assert tokens == expected

    # float8: FusedparTrainer trains the float8 model as torchao's in one process
    if importlib.util.find_spec("torchao") is not None:
        with accelerate_env():
            single_fp8 = trainer_losses(str(tmp_path / "single-fp8"), None, float8=FLOAT8, max_steps=2)
        assert len(fp8) == len(single_fp8) == 2 and fp8[0][0] != run[0][0], (fp8, run)
        for (loss, norm), (ref_loss, ref_norm) in zip(fp8, single_fp8):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (fp8, single_fp8)
            assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (fp8, single_fp8)
