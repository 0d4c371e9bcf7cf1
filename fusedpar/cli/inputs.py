"""What ``fusedpar train`` trains with a user's own inputs: ``--model PATH`` (a Hugging Face
model folder) and ``--data PATH`` (a token file or a ``datasets.save_to_disk`` folder).

Plain-PyTorch / transformers equivalent::

    config = AutoConfig.from_pretrained(path)
    model = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # weights there
             or AutoModelForCausalLM.from_config(config))                     # else seeded init
    tokens = np.memmap(data, dtype=np.uint16, mode="r")        # nanoGPT's train.bin
    rows = tokens[: len(tokens) // seq_len * seq_len].reshape(-1, seq_len)
    global_batch(step) = rows[(step * batch_size + arange(batch_size)) % len(rows)]

A saved dataset's ``input_ids`` rows are concatenated (packed) into one token stream, read
lazily. The global batch of a step depends on the step alone, so every world size sees the
same rows and each data-parallel rank takes its part (``shard_batch``); a resumed run
continues at its step's rows. :func:`data_problem` and :func:`model_problem` find what would
fail on every rank, before any is started.
"""

from __future__ import annotations

import os

import numpy as np
import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


# ---- --model PATH -------------------------------------------------------------------------


def hf_config(path: str):
    """The folder's ``config.json`` as a transformers config (training: no KV cache)."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {path}: no config.json there; give a Hugging Face model folder "
                         "(config.json, with weights to fine-tune from, without to train from "
                         "scratch)")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--model {path}: transformers cannot read its config.json "
                         f"({type(e).__name__}: {e})") from None
    config.use_cache = False
    return config


def has_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES)


def load_model(path: str, seed: int, device) -> torch.nn.Module:
    """The folder's causal LM in float32 on ``device``: its weights when it has some, else
    initialized from ``seed`` (the same on every rank)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" on every rank
    config = hf_config(path)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if has_weights(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config,
                                                                  dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device)


def model_problem(path: str) -> str | None:
    """Why ``parallelize`` cannot take the folder's model (checked on the meta device: its
    structure, not its forward), or None."""
    from fusedpar.parallel.adapters import find_adapter

    try:
        model = load_model(path, 0, "meta")
        find_adapter(model).layout(model)
    except (ValueError, TypeError) as e:
        return f"--model {path}: {e}" if not str(e).startswith("--model") else str(e)
    return None


# ---- --data PATH --------------------------------------------------------------------------


class TokenFile:
    """A flat array of token ids (``dtype`` uint16 or uint32, as nanoGPT writes them)."""

    def __init__(self, path: str, dtype: str):
        size = os.path.getsize(path)
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise ValueError(f"--data {path}: {size} bytes is not a whole number of {dtype} "
                             f"tokens; is --data-dtype right?")
        self.path = path
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return len(self.tokens)

    def span(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.tokens[start:stop])

    def max_id(self) -> int:
        return int(self.tokens.max()) if len(self.tokens) else -1


class SavedDataset:
    """The ``input_ids`` rows of a ``datasets.save_to_disk`` folder (its ``train`` split for
    a ``DatasetDict``) packed into one token stream."""

    def __init__(self, path: str):
        try:
            import datasets
        except ImportError:
            raise ValueError(f"--data {path}: reading a saved dataset needs the datasets "
                             "package: pip install 'fusedpar[hf]'") from None
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"--data {path}: a DatasetDict without a 'train' split "
                                 f"(it has {sorted(ds)})")
            ds = ds["train"]
        if "input_ids" not in ds.column_names:
            raise ValueError(f"--data {path}: no input_ids column (it has {ds.column_names}); "
                             "tokenize the dataset first (dataset.map(lambda r: tokenizer(r['text'])))")
        import pyarrow.compute as pc

        self.path, self.rows = path, ds.with_format("numpy", columns=["input_ids"])
        column = ds.data.column("input_ids")  # Arrow: lengths and the largest id without a copy
        self.ends = np.cumsum(pc.list_value_length(column).to_numpy(zero_copy_only=False))
        top = pc.max(pc.list_flatten(column)).as_py()
        self._max = -1 if top is None else int(top)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def span(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        rows = self.rows[first:last + 1]["input_ids"]
        flat = np.concatenate([np.asarray(r) for r in rows])
        offset = start - (int(self.ends[first - 1]) if first else 0)
        return flat[offset:offset + stop - start]

    def max_id(self) -> int:
        return self._max


def open_data(path: str, dtype: str = "uint16"):
    """A :class:`TokenFile` or, for a folder, a :class:`SavedDataset`."""
    if os.path.isdir(path):
        return SavedDataset(path)
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file or folder")
    return TokenFile(path, dtype)


class Batches:
    """The global batch of each step: rows of ``seq_len`` consecutive tokens, row
    ``(step * batch_size + i) mod rows`` (the data repeats after the last full row)."""

    def __init__(self, data, batch_size: int, seq_len: int):
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.rows = len(data) // seq_len

    def __call__(self, step: int) -> torch.Tensor:
        first = step * self.batch_size % self.rows
        out = []
        for i in range(self.batch_size):
            row = (first + i) % self.rows
            out.append(self.data.span(row * self.seq_len, (row + 1) * self.seq_len).astype(np.int64))
        return torch.from_numpy(np.stack(out))


def data_problem(path: str, dtype: str, vocab: int, batch_size: int, seq_len: int) -> str | None:
    """Why ``--data path`` cannot feed this run, or None: unreadable, shorter than one global
    batch, or a token id outside the model's vocabulary."""
    try:
        data = open_data(path, dtype)
    except (ValueError, OSError) as e:
        return str(e) if str(e).startswith("--data") else f"--data {path}: {type(e).__name__}: {e}"
    need = batch_size * seq_len
    if len(data) < need:
        return (f"--data {path}: {len(data):,} tokens, too few for one batch of {batch_size} x "
                f"{seq_len} = {need:,} tokens; lower --batch-size or --seq-len, or give more data")
    top = data.max_id()
    if top >= vocab:
        hint = (" (is it a uint32 file? pass --data-dtype uint32)"
                if isinstance(data, TokenFile) and dtype == "uint16" else "")
        return (f"--data {path}: token id {top:,} is outside the model's vocabulary of {vocab:,}"
                f"{hint}; tokenize with the model's tokenizer")
    if dtype == "uint16" and vocab > 1 << 16 and isinstance(data, TokenFile):
        return (f"--data {path}: a vocabulary of {vocab:,} does not fit uint16 tokens: pass "
                "--data-dtype uint32")
    return None
