"""Training a model parallelized by ``fusedpar.parallelize`` with other libraries' loops:
:mod:`fusedpar.integrations.hf` for Hugging Face ``transformers.Trainer`` and
``accelerate.Accelerator`` (``pip install 'fusedpar[hf]'``)."""
