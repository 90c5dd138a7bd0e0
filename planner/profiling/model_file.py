"""Loads a user's model file and checks the model-file contract.

The contract: the file defines
- `build_model() -> torch.nn.Module` (required),
- `example_batch(batch_size: int) -> (inputs, target)` (required); `inputs` is a tensor, a
  tuple of tensors (`model(*inputs)`) or a dict of them by the forward's argument names
  (`model(**inputs)`: made positional where the file is loaded, `planner.profiling.keyword_inputs`),
  each with the batch first; `target` is a tensor,
- `loss_fn(output, target) -> Tensor` (optional, a scalar). Without it, `default_loss` is used.
- `data_loader(batch_size: int) -> Iterable[(inputs, target)]` (optional): real training data for
  `runtime.train` / `planner train`, e.g. a `torch.utils.data.DataLoader`, in mini-batches of
  `batch_size` samples shaped as `example_batch`'s (use `drop_last=True`). It is called once and
  iterated once per epoch. Every rank iterates its own copy, so it must give every rank the same
  batches in the same order: seed any shuffling with a `torch.Generator` of a fixed seed. Without
  it, training reuses one `example_batch`.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from planner.errors import ModelFileError
from planner.profiling.generation_cache import turn_off_generation_cache
from planner.profiling.keyword_inputs import InputNamesError, KeywordInputs

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelFile:
    """The contract's functions of one loaded model file."""

    path: str
    name: str
    build_model: Callable[[], torch.nn.Module]
    example_batch: Callable[[int], Any]
    loss_fn: LossFn | None
    module: ModuleType
    data_loader: Callable[[int], Any] | None = None
    keyword_inputs: KeywordInputs | None = None  # the names of inputs given by name, once a batch has shown them


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Loss used when the model file defines no `loss_fn`.

    - integer `target`: cross entropy over the last dimension of `output`
      (`F.cross_entropy(output.reshape(-1, C), target.reshape(-1))`, C = output.shape[-1]);
    - floating `target`: mean squared error `F.mse_loss(output, target)`.

    An output that is not a tensor but holds one as `logits` (a transformers `ModelOutput`) stands for that tensor.
    """
    logits = getattr(output, "logits", None)
    if not isinstance(output, torch.Tensor) and isinstance(logits, torch.Tensor):
        output = logits
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the default loss needs the model to return a tensor or an output with a `logits` tensor, "
                        f"got {type(output).__name__}")
    if target.is_floating_point():
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def load_model_file(path: str | Path) -> ModelFile:
    """Import `path` as a module and return its contract functions, or raise ModelFileError."""
    path_str = str(path)
    file_path = Path(path)
    if not file_path.exists():
        raise ModelFileError(path_str, "no such file", "check the path to your model file")
    if not file_path.is_file():
        raise ModelFileError(path_str, "is not a file", "pass the path of a Python file")
    if file_path.suffix != ".py":
        raise ModelFileError(path_str, "is not a Python file (expected a .py file)", "pass a .py model file")
    try:
        source = file_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelFileError(path_str, "is not UTF-8 text", "pass a Python source file") from None
    try:
        compile(source, path_str, "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        where = f" at line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise ModelFileError(path_str, f"syntax error{where}: {message}", "fix the Python syntax") from None
    module_name = f"_planner_model_{file_path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    if spec is None or spec.loader is None:
        raise ModelFileError(path_str, "cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's module code raised (or exited) while importing
        sys.modules.pop(module_name, None)
        raise ModelFileError(
            path_str, f"raised {type(exc).__name__} while importing: {exc}", "fix the error in the model file"
        ) from exc
    build_model = _required_function(module, path_str, "build_model", "def build_model() -> torch.nn.Module")
    example_batch = _required_function(
        module, path_str, "example_batch", "def example_batch(batch_size: int) -> (inputs, target)"
    )
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(path_str, "loss_fn is not a function", "define def loss_fn(output, target) -> Tensor")
    data_loader = getattr(module, "data_loader", None)
    if data_loader is not None and not callable(data_loader):
        raise ModelFileError(path_str, "data_loader is not a function",
                             "define def data_loader(batch_size) -> iterable of (inputs, target)")
    keyword_inputs = KeywordInputs(example_batch)
    build_model, example_batch, data_loader = keyword_inputs.adapt(build_model, data_loader)
    return ModelFile(
        path=path_str, name=file_path.stem, build_model=build_model, example_batch=example_batch,
        loss_fn=loss_fn, module=module, data_loader=data_loader, keyword_inputs=keyword_inputs,
    )


def _required_function(module: ModuleType, path: str, name: str, signature: str) -> Callable[..., Any]:
    """The callable `name` of `module`, or ModelFileError saying how to define it."""
    function = getattr(module, name, None)
    if function is None:
        raise ModelFileError(path, f"required function {name}() is missing", f"define {signature}")
    if not callable(function):
        raise ModelFileError(path, f"{name} is not a function", f"define {signature}")
    return function


def build_checked_model(model_file: ModelFile) -> torch.nn.Module:
    """Call `build_model()` and check it returns an nn.Module with parameters; a transformers model's generation
    cache is turned off, as training does not read it (`planner.profiling.generation_cache`)."""
    try:
        model = model_file.build_model()
    except InputNamesError as exc:  # raised as the built model is made to take example_batch's inputs by name
        raise ModelFileError(model_file.path, f"example_batch() gives {exc}",
                             "name the inputs in example_batch() as the model's forward names its arguments") from exc
    except (Exception, SystemExit) as exc:
        raise ModelFileError(
            model_file.path, f"build_model() raised {type(exc).__name__}: {exc}", "fix build_model()"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            model_file.path, f"build_model() returned {type(model).__name__}, expected torch.nn.Module",
            "return the model instance",
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(
            model_file.path, "build_model() returned a model without trainable parameters",
            "return a model with parameters to train",
        )
    turn_off_generation_cache(model)
    return model


def checked_example_batch(model_file: ModelFile, batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Call `example_batch(batch_size)`; return (inputs as a tuple, target) after checking types and batch dim."""
    try:
        batch = model_file.example_batch(batch_size)
    except (Exception, SystemExit) as exc:
        raise ModelFileError(
            model_file.path, f"example_batch({batch_size}) raised {type(exc).__name__}: {exc}",
            "fix example_batch()",
        ) from exc
    return checked_batch(model_file, batch, batch_size, f"example_batch({batch_size}) returned")


def checked_batch(model_file: ModelFile, batch: Any, batch_size: int,
                  said: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`batch`, which the model file's `said` ("example_batch(8) returned", "data_loader(8) yielded"), as (inputs as
    a tuple, target) after checking the contract: a pair, inputs a tensor or tuple of tensors, target a tensor, each
    with `batch_size` first, and under the default loss no target that is one of the inputs
    (`_target_copying_an_input`); ModelFileError naming what is not."""
    expected = ("expected a pair (inputs, target) with inputs a tensor, a tuple of tensors or a dict of them by "
                "the model's argument names, and target a tensor")
    if isinstance(batch, Mapping):  # a Hugging Face collator's: the inputs and the labels by name
        keys = ", ".join(map(str, batch))
        raise ModelFileError(
            model_file.path, f"{said} a dict ({keys}), not a pair (inputs, target)",
            "give the model's inputs and the target apart, e.g. ({'input_ids': ..., 'attention_mask': ...}, labels)")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(model_file.path, f"{said} {_describe(batch)}", expected)
    inputs, target = batch  # inputs given by name are a tuple already (`KeywordInputs`, where the file is loaded)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ModelFileError(model_file.path, f"{said} inputs of {_describe(inputs)}", expected)
    if not isinstance(target, torch.Tensor):
        raise ModelFileError(model_file.path, f"{said} a target of {_describe(target)}", expected)
    for position, tensor in enumerate([*inputs, target]):
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            what = "target" if position == len(inputs) else f"input {position}"
            raise ModelFileError(
                model_file.path,
                f"{said} {what} of shape {tuple(tensor.shape)}, whose first dimension is not the batch size "
                f"{batch_size}",
                "put the batch in the first dimension",
            )
    copied = _target_copying_an_input(model_file, tuple(inputs), target)
    if copied is not None:
        raise ModelFileError(
            model_file.path,
            f"{said} a target equal to {copied}: the default loss compares the output at each position "
            "with the target at the same position, so the model would learn to copy its input",
            "give the next tokens as the target (inputs ids[:, :-1], target ids[:, 1:]), as transformers' models do "
            "inside with their labels, or define loss_fn(output, target)")
    return tuple(inputs), target


IGNORE_INDEX = -100  # the target value cross entropy skips (`F.cross_entropy`'s default; transformers' padding label)
MIN_COPIED_POSITIONS = 64  # fewer counted positions than this are not checked: a chance match is then too likely


def _target_copying_an_input(model_file: ModelFile, inputs: tuple[torch.Tensor, ...], target: torch.Tensor
                             ) -> str | None:
    """The input a sequence of integer targets repeats ("the input input_ids", "input 0") where the default loss
    would compare them position by position (a causal LM's labels given as transformers takes them, unshifted), else
    None.

    A target "repeats" an input of its shape and dtype when they are equal wherever the target is not IGNORE_INDEX
    (a collator's padding), at MIN_COPIED_POSITIONS or more positions and at least half of the target's, where the
    input is not one value throughout. Not checked: a model file's own loss_fn, float targets, a target of fewer than
    2 dimensions or a last dimension of 1, and inputs named like `labels`, which a model reads as labels (T5 and BART
    shift them into the decoder's inputs, so their logits line up with the labels). The half leaves out a masked
    language model's labels (a few masked positions, some left unchanged); the least count and the one value, chance
    matches of small batches (a sentence without entities, all 0, against an all-0 token_type_ids)."""
    if model_file.loss_fn is not None or target.is_floating_point() or target.dim() < 2 or target.shape[-1] < 2:
        return None
    counted = target != IGNORE_INDEX
    positions = int(counted.sum())
    if positions < max(MIN_COPIED_POSITIONS, target.numel() / 2):
        return None
    names = model_file.keyword_inputs.names if model_file.keyword_inputs is not None else None
    for position, tensor in enumerate(inputs):
        name = names[position] if names else None
        if name is not None and name.endswith("labels"):
            continue
        if tensor.shape != target.shape or tensor.dtype != target.dtype:
            continue
        values = tensor[counted]
        if bool((values != values[0]).any()) and torch.equal(values, target[counted]):
            return f"the input {name}" if name is not None else f"input {position}"
    return None


def _describe(value: Any) -> str:
    """Short description of a value's type (and length for sequences) for error messages."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of {len(value)} ({inner})"
    return f"type {type(value).__name__}"
