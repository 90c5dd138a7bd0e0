"""Tests of the model-file contract (planner.profiling.model_file): loading, checked model and batch, default loss."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from planner.errors import ModelFileError
from planner.profiling.model_file import (
    ModelFile,
    build_checked_model,
    checked_example_batch,
    default_loss,
    load_model_file,
)

VALID = """
import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))
"""

HEADER = """
import torch
from torch import nn
"""

GOOD_MODEL = """
def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))
"""

GOOD_BATCH = """
def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))
"""


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    """Write `source` (dedented) as the file `name` in tmp_path and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def load_error(path: Path) -> ModelFileError:
    """The ModelFileError raised by loading `path`; checks that it names the file."""
    with pytest.raises(ModelFileError) as info:
        load_model_file(path)
    assert str(path) in str(info.value)
    assert info.value.path == str(path)
    return info.value


def model_error(path: Path) -> ModelFileError:
    """The ModelFileError raised by build_checked_model for the file at `path`; checks it names the file."""
    model_file = load_model_file(path)
    with pytest.raises(ModelFileError) as info:
        build_checked_model(model_file)
    assert str(path) in str(info.value)
    return info.value


def batch_error(path: Path, batch_size: int = 2) -> ModelFileError:
    """The ModelFileError raised by checked_example_batch for the file at `path`; checks it names the file."""
    model_file = load_model_file(path)
    with pytest.raises(ModelFileError) as info:
        checked_example_batch(model_file, batch_size)
    assert str(path) in str(info.value)
    return info.value


def test_valid_file_loads_and_checks(tmp_path: Path) -> None:
    path = write(tmp_path, VALID, "tiny_mlp.py")
    model_file = load_model_file(path)
    assert isinstance(model_file, ModelFile)
    assert model_file.path == str(path)
    assert model_file.name == "tiny_mlp"
    assert model_file.loss_fn is None
    model = build_checked_model(model_file)
    assert isinstance(model, torch.nn.Sequential)
    inputs, target = checked_example_batch(model_file, 3)
    assert isinstance(inputs, tuple) and len(inputs) == 1
    assert inputs[0].shape == (3, 4)
    assert target.shape == (3,)


def test_missing_file(tmp_path: Path) -> None:
    error = load_error(tmp_path / "absent.py")
    assert "no such file" in str(error)


def test_directory(tmp_path: Path) -> None:
    directory = tmp_path / "package.py"
    directory.mkdir()
    error = load_error(directory)
    assert "is not a file" in str(error)


def test_not_a_python_file(tmp_path: Path) -> None:
    path = write(tmp_path, VALID, "model.txt")
    error = load_error(path)
    assert "not a Python file" in str(error)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.py"
    path.write_bytes(b"# caf\xe9\nx = 1\n")
    error = load_error(path)
    assert "not UTF-8" in str(error)


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\n\ndef build_model(:\n    pass\n")
    error = load_error(path)
    assert "syntax error" in str(error)
    assert "line 4" in str(error)


def test_module_raising_at_import(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + "raise KeyError('no dataset configured')\n")
    error = load_error(path)
    assert "KeyError" in str(error)
    assert "no dataset configured" in str(error)
    assert isinstance(error.__cause__, KeyError)


def test_build_model_missing(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + GOOD_BATCH)
    error = load_error(path)
    assert "build_model() is missing" in str(error)


def test_example_batch_missing(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + GOOD_MODEL)
    error = load_error(path)
    assert "example_batch() is missing" in str(error)


def test_build_model_not_callable(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + "build_model = 3\n" + GOOD_BATCH)
    error = load_error(path)
    assert "build_model is not a function" in str(error)


def test_loss_fn_not_callable(tmp_path: Path) -> None:
    path = write(tmp_path, VALID + "\nloss_fn = 'mse'\n")
    error = load_error(path)
    assert "loss_fn is not a function" in str(error)


def test_build_model_returning_a_non_module(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + "def build_model():\n    return 42\n" + GOOD_BATCH)
    error = model_error(path)
    assert "returned int" in str(error)
    assert "torch.nn.Module" in str(error)


def test_build_model_raising(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + "def build_model():\n    raise RuntimeError('weights not found')\n" + GOOD_BATCH)
    error = model_error(path)
    assert "RuntimeError" in str(error)
    assert "weights not found" in str(error)


@pytest.mark.parametrize(
    "body",
    ["return nn.ReLU()", "model = nn.Linear(4, 4)\n    model.requires_grad_(False)\n    return model"],
    ids=["no-parameters", "frozen-parameters"],
)
def test_model_without_trainable_parameters(tmp_path: Path, body: str) -> None:
    path = write(tmp_path, HEADER + f"def build_model():\n    {body}\n" + GOOD_BATCH)
    error = model_error(path)
    assert "without trainable parameters" in str(error)


def batch_file(tmp_path: Path, returned: str) -> Path:
    """A model file whose example_batch(batch_size) returns the expression `returned`."""
    return write(tmp_path, HEADER + GOOD_MODEL + f"def example_batch(batch_size):\n    return {returned}\n")


@pytest.mark.parametrize(
    "returned",
    ["torch.randn(batch_size, 4)", "(torch.randn(batch_size, 4),)", "[torch.randn(batch_size, 4)] * 3", "None"],
    ids=["a-tensor", "a-1-tuple", "a-3-list", "none"],
)
def test_example_batch_not_a_pair(tmp_path: Path, returned: str) -> None:
    error = batch_error(batch_file(tmp_path, returned))
    assert "example_batch(2) returned" in str(error)
    assert "expected a pair (inputs, target)" in str(error)


@pytest.mark.parametrize(
    "inputs",
    ["[[1.0, 2.0, 3.0, 4.0]] * batch_size", "'features'", "()", "(torch.randn(batch_size, 4), 3)"],
    ids=["nested-list", "string", "empty-tuple", "tuple-with-int"],
)
def test_example_batch_inputs_not_tensors(tmp_path: Path, inputs: str) -> None:
    error = batch_error(batch_file(tmp_path, f"{inputs}, torch.zeros(batch_size)"))
    assert "returned inputs of" in str(error)


def test_example_batch_inputs_by_name_are_passed_by_name(tmp_path: Path) -> None:
    """A tokenizer's dict of inputs: the batch's inputs become a tuple in the dict's order, and the built model takes
    them so, passing each to its forward by name (the forward's own order is another here)."""
    path = write(tmp_path, HEADER + textwrap.dedent("""
        class Named(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(4, 3)

            def forward(self, attention_mask, input_ids):
                return self.embed(input_ids) * attention_mask


        def build_model():
            return Named()


        def example_batch(batch_size):
            return {'input_ids': torch.randn(batch_size, 4), 'attention_mask': torch.ones(batch_size, 3)}, torch.zeros(batch_size)
    """))
    model_file = load_model_file(path)
    (ids, mask), _ = checked_example_batch(model_file, 2)
    assert ids.shape == (2, 4) and mask.shape == (2, 3)
    model = build_checked_model(model_file)
    assert type(model).__name__ == "Named" and list(model.state_dict()) == ["embed.weight", "embed.bias"]
    torch.testing.assert_close(model(ids, torch.zeros(2, 3)), torch.zeros(2, 3))
    torch.testing.assert_close(model(ids, mask), model.embed(ids) * mask)  # the forward's own, by name


def test_example_batch_as_one_dict_with_the_labels_says_to_give_inputs_and_target(tmp_path: Path) -> None:
    """A Hugging Face collator's batch is one dict, the labels in it: not a pair (inputs, target)."""
    error = batch_error(batch_file(tmp_path, "{'input_ids': torch.zeros(batch_size, 4), "
                                             "'labels': torch.zeros(batch_size)}"))
    assert str(error).endswith(": example_batch(2) returned a dict (input_ids, labels), not a pair (inputs, target); "
                               "give the model's inputs and the target apart, e.g. ({'input_ids': ..., "
                               "'attention_mask': ...}, labels)")


@pytest.mark.parametrize(
    ("target", "described"),
    [("[0] * batch_size", "a list of 2 (int, int)"), ("3", "type int"), ("None", "type NoneType")],
    ids=["list", "int", "none"],
)
def test_example_batch_target_not_a_tensor(tmp_path: Path, target: str, described: str) -> None:
    error = batch_error(batch_file(tmp_path, f"torch.randn(batch_size, 4), {target}"))
    assert f"returned a target of {described}" in str(error)


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        ("torch.randn(batch_size + 1, 4), torch.zeros(batch_size)", "input 0"),
        ("(torch.randn(batch_size, 4), torch.randn(4, batch_size)), torch.zeros(batch_size)", "input 1"),
        ("torch.randn(batch_size, 4), torch.zeros(batch_size * 2)", "target"),
        ("torch.randn(batch_size, 4), torch.tensor(0.0)", "target"),
    ],
    ids=["input-too-long", "second-input-transposed", "target-too-long", "scalar-target"],
)
def test_example_batch_first_dimension_not_the_batch(tmp_path: Path, returned: str, what: str) -> None:
    error = batch_error(batch_file(tmp_path, returned), batch_size=2)
    assert f"returned {what} of shape" in str(error)
    assert "not the batch size 2" in str(error)


def test_example_batch_raising(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + GOOD_MODEL + "def example_batch(batch_size):\n    return 1 / 0\n")
    error = batch_error(path, batch_size=5)
    assert "example_batch(5) raised ZeroDivisionError" in str(error)


def test_inputs_as_a_tuple_of_two_tensors(tmp_path: Path) -> None:
    path = batch_file(
        tmp_path, "(torch.randn(batch_size, 4), torch.randn(batch_size, 3, 2)), torch.randn(batch_size, 4)"
    )
    model_file = load_model_file(path)
    inputs, target = checked_example_batch(model_file, 2)
    assert isinstance(inputs, tuple)
    assert [tuple(t.shape) for t in inputs] == [(2, 4), (2, 3, 2)]
    assert tuple(target.shape) == (2, 4)


def test_inputs_as_a_list_become_a_tuple(tmp_path: Path) -> None:
    path = batch_file(tmp_path, "[torch.randn(batch_size, 4), torch.randn(batch_size, 4)], torch.zeros(batch_size)")
    inputs, _target = checked_example_batch(load_model_file(path), 2)
    assert isinstance(inputs, tuple) and len(inputs) == 2


SEQUENCES = """
def example_batch(batch_size):
    ids, source = torch.randint(0, 9, (2, batch_size, 40))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)  # a collator's: the padding's labels left out of the loss
    return {returned}
"""


@pytest.mark.parametrize(
    ("returned", "named"),
    [
        ("ids, ids", "input 0"),
        ("(mask, ids), ids.clone()", "input 1"),
        ("{'input_ids': ids, 'attention_mask': mask}, labels", "the input input_ids"),
    ],
    ids=["the-same-tensor", "a-copy-of-the-second", "a-collators-labels-by-name"],
)
def test_a_target_repeating_an_input_under_the_default_loss_is_refused(tmp_path: Path, returned: str,
                                                                       named: str) -> None:
    """transformers' labels are the inputs, shifted inside its models: the default loss would train on them position
    by position, the model learning to copy its input; one line says so before anything runs."""
    error = batch_error(write(tmp_path, HEADER + GOOD_MODEL + SEQUENCES.format(returned=returned)))
    assert str(error).endswith(
        f": example_batch(2) returned a target equal to {named}: the default loss compares the output at each "
        "position with the target at the same position, so the model would learn to copy its input; give the next "
        "tokens as the target (inputs ids[:, :-1], target ids[:, 1:]), as transformers' models do inside with their "
        "labels, or define loss_fn(output, target)")


@pytest.mark.parametrize(
    ("returned", "loss"),
    [
        ("ids[:, :-1], ids[:, 1:]", ""),  # next tokens
        ("ids, ids", "def loss_fn(output, target):\n    return output.sum()\n"),  # the file's own loss says how
        ("ids.float(), ids.float()", ""),  # an autoencoder's target: mean squared error
        ("ids[:, 0], ids[:, 0]", ""),  # one class per sample, not a sequence
        ("ids, torch.full_like(ids, -100)", ""),  # nothing counted
        ("ids, ids.int()", ""),  # another dtype
        ("{'input_ids': source, 'labels': ids}, ids", ""),  # T5's: the model shifts its labels into the decoder
        ("(ids, torch.zeros_like(ids)), torch.zeros_like(ids)", ""),  # a sentence without entities, no token types
        # masked LM labels at 15% of 800 positions, the inputs left unchanged there (as 10% of them are)
        ("(long := torch.cat([ids] * 10, 1)), long.masked_fill(torch.rand(long.shape) > 0.15, -100)", ""),
        ("ids[:, :20], ids[:, :20]", ""),  # 40 positions: too few to tell a copy from chance
    ],
    ids=["shifted", "own-loss", "floats", "per-sample", "all-ignored", "other-dtype", "labels-by-name", "constant",
         "masked-lm", "few-positions"],
)
def test_targets_that_do_not_repeat_a_sequence_input_under_the_default_loss_pass(tmp_path: Path, returned: str,
                                                                                 loss: str) -> None:
    path = write(tmp_path, HEADER + GOOD_MODEL + SEQUENCES.format(returned=returned) + loss)
    _inputs, target = checked_example_batch(load_model_file(path), 2)
    assert target.shape[0] == 2


def test_default_loss_integer_targets_is_cross_entropy_over_flattened_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    target = torch.randint(0, 5, (2, 3))
    expected = F.cross_entropy(logits.reshape(-1, 5), target.reshape(-1))
    assert torch.allclose(default_loss(logits, target), expected)
    flat_logits = torch.randn(4, 5)
    flat_target = torch.randint(0, 5, (4,))
    assert torch.allclose(default_loss(flat_logits, flat_target), F.cross_entropy(flat_logits, flat_target))


def test_default_loss_float_targets_is_mse() -> None:
    torch.manual_seed(0)
    output = torch.randn(3, 4)
    target = torch.randn(3, 4)
    loss = default_loss(output, target)
    assert loss.dim() == 0
    assert torch.allclose(loss, F.mse_loss(output, target))
    assert torch.allclose(loss, ((output - target) ** 2).mean())


def test_default_loss_needs_a_tensor_output() -> None:
    with pytest.raises(TypeError, match="tuple"):
        default_loss((torch.randn(2, 2),), torch.randn(2, 2))


def test_default_loss_reads_the_logits_of_a_model_output() -> None:
    """A transformers model returned as it is gives a ModelOutput: the default loss uses its `logits`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    output = transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)
    assert torch.equal(default_loss(output, target), default_loss(logits, target))
    with pytest.raises(TypeError, match="a `logits` tensor, got dict"):
        default_loss({"hidden": logits}, target)


def test_the_built_model_has_its_generation_cache_off(tmp_path: Path) -> None:
    """Training never reads a transformers model's generation cache, and a split cannot return it."""
    pytest.importorskip("transformers")
    path = write(tmp_path, """
        import torch
        import transformers

        def build_model():
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                                        n_positions=8))

        def example_batch(batch_size):
            return torch.randint(0, 16, (batch_size, 4)), torch.randint(0, 16, (batch_size, 4))
    """)
    model = build_checked_model(load_model_file(path))
    assert model.config.use_cache is False
    assert model(torch.randint(0, 16, (2, 4))).past_key_values is None


def test_inputs_by_names_the_forward_does_not_take_are_one_line_saying_to_fix_example_batch(tmp_path: Path) -> None:
    path = write(tmp_path, HEADER + textwrap.dedent("""
        def build_model():
            return nn.Sequential(nn.Linear(4, 4))


        def example_batch(batch_size):
            return {'input_ids': torch.randn(batch_size, 4), 'labels': torch.zeros(batch_size)}, torch.zeros(batch_size)
    """))
    error = model_error(path)
    assert str(error).endswith(": example_batch() gives inputs named input_ids, labels, which Sequential.forward does "
                               "not take (its arguments: input); name the inputs in example_batch() as the model's "
                               "forward names its arguments")
