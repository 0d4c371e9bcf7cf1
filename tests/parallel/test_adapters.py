"""Model adapters: the registry finds each family's adapter by structure, refuses other
models listing the families and how to register one, and a registered adapter wins; and
``fusedpar.parallel`` does not depend on ``fusedpar.models`` (parsed imports)."""

import ast
import pathlib

import pytest
import torch
from torch import nn

import fusedpar
from fusedpar.parallel import adapters
from fusedpar.parallel.adapters import ModelAdapter, find_adapter, register_adapter
from tests.parallel.parallel_cases import make_model

PARALLEL = pathlib.Path(fusedpar.__file__).parent / "parallel"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (function bodies too), made absolute."""
    package = ".".join(path.relative_to(PARALLEL.parent.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_parallel_does_not_import_models():
    files = sorted(PARALLEL.rglob("*.py"))
    assert len(files) > 5
    seen = {f: _imported_modules(f) for f in files}
    assert any("fusedpar.parallel.config" in names for names in seen.values())  # parsing works
    bad = {str(f.relative_to(PARALLEL)): sorted(n for n in names if n.startswith("fusedpar.models"))
           for f, names in seen.items()}
    assert not any(bad.values()), bad


def test_import_parser_resolves_relative_imports():
    # the check above is only as good as this: "from ..models import x" inside fusedpar/parallel
    probe = PARALLEL / "adapters" / "own.py"
    assert "fusedpar.nn.attention" in _imported_modules(probe)  # from ...nn.attention import
    assert "fusedpar.parallel.adapters.base" in _imported_modules(probe)  # from .base import


@pytest.mark.parametrize("kind, family", [
    ("llama", "fusedpar.models"), ("mixtral", "fusedpar.models"),
    ("hf-llama", "LlamaForCausalLM"), ("hf-qwen2", "Qwen2ForCausalLM"),
    ("hf-mixtral", "MixtralForCausalLM"), ("hf-qwen2-moe", "Qwen2MoeForCausalLM"),
    ("hf-qwen3-moe", "Qwen3MoeForCausalLM"), ("hf-olmoe", "OlmoeForCausalLM"),
    ("hf-deepseek-v3", "DeepseekV3ForCausalLM"), ("hf-gemma2", "Gemma2ForCausalLM"),
    ("hf-gpt2", "GPT2LMHeadModel"), ("hf-mistral", "any other model with Llama's layout")])
def test_each_family_finds_its_adapter(kind, family):
    if kind.startswith("hf-"):
        pytest.importorskip("transformers")
    adapter = find_adapter(make_model(kind))
    assert family in adapter.family, adapter.family


def test_unsupported_model_lists_families_and_how_to_register():
    class NotAnLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    model = NotAnLM()
    with pytest.raises(TypeError) as info:
        find_adapter(model).layout(model)
    message = str(info.value)
    assert "NotAnLM is not a supported model (no model; no lm_head)" in message
    for adapter in adapters.ADAPTERS:
        assert adapter.family in message
    assert "register_adapter(MyAdapter())" in message


def test_registered_adapter_wins():
    class Scaled(ModelAdapter):
        family = "scaled llama"

        def matches(self, model):
            return getattr(model, "scaled", False)

        def embed(self, model, input_ids, position_ids):
            return 2 * super().embed(model, input_ids, position_ids)

    model = make_model("llama")
    model.scaled = True
    ids = torch.arange(8)[None]
    plain = fusedpar.parallel.forward.decoder_forward(model, ids, None, adapter=ModelAdapter())[0]
    adapter = register_adapter(Scaled())
    try:
        assert find_adapter(model) is adapter
        scaled = fusedpar.parallel.forward.decoder_forward(model, ids, None)[0]
        assert not torch.allclose(scaled, plain)
        assert find_adapter(make_model("llama")).family.startswith("fusedpar.models")
    finally:
        adapters.ADAPTERS.remove(adapter)
    with pytest.raises(TypeError, match="expected a ModelAdapter"):
        register_adapter(object())


@pytest.mark.parametrize("kind", ["hf-llama-eager", "hf-gemma2"])
def test_attention_masks_warn_about_nothing(kind):
    """The masks the HF adapters build come without transformers' deprecation warning
    (its mask builders deprecate ``past_key_values`` for ``cache``, which warned on every
    forward of every rank)."""
    import warnings

    model = make_model(kind)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        masks = find_adapter(model).attention_masks(model, ids, torch.arange(8)[None])
    assert len(masks) == model.config.num_hidden_layers
