"""Training a model parallelized by ``fusedpar.parallelize`` with other libraries' loops:
:mod:`fusedpar.integrations.hf` for Hugging Face ``transformers.Trainer`` and
``accelerate.Accelerator`` (``pip install 'fusedpar[hf]'``). Its names are also reachable
here (imported on first use: transformers and accelerate are optional)."""

_HF = ("FusedparTrainer", "prepare_accelerator", "unparallelized")


def __getattr__(name: str):
    if name in _HF:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'fusedpar.integrations' has no attribute {name!r}")


__all__ = list(_HF)
