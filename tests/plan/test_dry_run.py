"""fusedpar.plan.dry_run: the real parallelized model under fake tensors and a fake process
group, against the planner's formulas."""

import pytest

from fusedpar.models import LlamaConfig
from fusedpar.plan import Candidate, Training, estimate_memory, model_spec
from fusedpar.plan.dry_run import dry_run

# Llama 3 8B's sizes
LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       intermediate_size=14336, max_seq_len=8192)


@pytest.mark.timeout(300)
def test_8b_on_64_fake_ranks_agrees_with_the_formulas():
    """FSDP over 64 ranks, bf16 compute, one 8192-token sequence per rank: parameters,
    gradients and optimizer state exactly as planned, the peak within 10%."""
    got = dry_run(LLAMA_8B, {"dp_shard": 64, "param_dtype": "bfloat16"}, 64, seq_len=8192)
    plan = estimate_memory(model_spec(LLAMA_8B), Candidate(dp_shard=64),
                           Training(seq_len=8192, global_batch=64, compute_dtype="bfloat16",
                                    foreach=False, units_in_flight=1))
    assert (got.params, got.grads, got.optimizer) == (plan.params, plan.params, plan.optimizer)
    assert abs(plan.peak / got.peak - 1) <= 0.10, (plan.peak, got.peak, got.breakdown)
    print(f"dry run of 8B on 64 fake ranks: {got.seconds:.1f} s, peak {got.peak / 2**30:.2f} GiB, "
          f"planned {plan.peak / 2**30:.2f} GiB")


def test_refuses_an_initialized_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="process of its own"):
        dry_run(LlamaConfig(), {"dp_shard": 2}, 2, seq_len=8)


def test_tied_embeddings_are_counted_once():
    """A tied model stays tied through the dry run's meta -> fake-CPU move: its parameter,
    gradient and optimizer bytes are the plan's, which counts the shared weight once."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=48, tie_embeddings=True)
    got = dry_run(config, {"dp_shard": 2}, 2, seq_len=16)
    plan = estimate_memory(model_spec(config), Candidate(dp_shard=2),
                           Training(seq_len=16, global_batch=2, foreach=False, units_in_flight=1))
    assert (got.params, got.grads, got.optimizer) == (plan.params, plan.params, plan.optimizer)
