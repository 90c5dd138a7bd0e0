"""Inputs given by name: a model file whose batches hold a dict of tensors, for a model called as `model(**inputs)`.

A Hugging Face user's batch is a tokenizer's or collator's dict (`input_ids`, `attention_mask`, ...), and
passing it positionally is wrong for some models (GPT-2's second argument is `past_key_values`). The
rest of the planner (profiler, split, runtimes) passes inputs positionally, so a model file with named
inputs is made positional once, where it is loaded (`KeywordInputs.adapt`):
- each batch's dict becomes the tuple of its tensors in the order of the names (the keys of the first
  dict seen); a dict with other names raises ValueError naming both;
- the model is given a forward that takes those tensors positionally, under their names, and calls
  its own forward with them by name (`keyword_model`): its class becomes a subclass of the same name, so
  its modules, parameters, names and state dict stay as they are. That object is the planner's (it
  profiles and trains it; checkpoints are state dicts): pickling it whole or generating with it needs
  its own class back (`without_keyword_inputs`).
The names are those of example_batch's first dict; where the model is built before any batch was
made, one `example_batch(1)` finds them, made with the random states of torch (its CPU generator, and
the GPUs' where CUDA is initialised), Python and NumPy kept, so the batches draw as they would without it.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["InputNamesError", "KeywordInputs", "keyword_model", "own_class", "without_keyword_inputs"]


class InputNamesError(ValueError):
    """The batches' input names cannot be the model's arguments: a name its forward does not take, or one no argument
    can have."""


@dataclass
class KeywordInputs:
    """The input names of one model file: None until found, then a tuple (empty where inputs are positional)."""

    example_batch: Callable[[int], Any]  # the model file's own
    names: tuple[str, ...] | None = None
    probe_failure: str | None = None  # what example_batch(1) raised when `found` made it

    def found(self) -> tuple[str, ...]:
        """The names, from one `example_batch(1)` if not yet known (random states kept); () where that batch is not
        a pair with a dict of inputs, or raises (the caller's own call of example_batch reports it then, and a
        dict of inputs after it is refused: the model was built to take its inputs by position)."""
        if self.names is None:
            try:
                with _random_states_kept():
                    batch = self.example_batch(1)
            except (Exception, SystemExit) as exc:
                self.names, self.probe_failure = (), f"{type(exc).__name__}: {exc}"
                return ()
            if _named(batch):
                self.positional(batch)
            else:
                self.names = ()
        return self.names

    def positional(self, batch: Any) -> Any:
        """`batch` with a dict of inputs made the tuple of its tensors in the names' order (the first dict's keys
        name them); any other batch as it is (the contract's checks report what is wrong with it)."""
        if not _named(batch):
            return batch
        inputs, target = batch
        names = tuple(inputs)
        if self.names is None:
            _check_names(names)
            self.names = names
        if not self.names:
            if self.probe_failure is not None:
                raise ValueError(f"inputs named {', '.join(map(str, names))}, but example_batch(1), which the planner "
                                 f"makes to find the names as the model is built, raised {self.probe_failure}: make "
                                 "example_batch(1) work")
            raise ValueError(f"inputs named {', '.join(map(str, names))}, where example_batch gives them by "
                             "position: give them one way")
        if set(names) != set(self.names):
            raise ValueError(f"inputs named {', '.join(map(str, names))}, where example_batch's are "
                             f"{', '.join(self.names)}: give every batch the same names")
        return tuple(inputs[name] for name in self.names), target

    def adapt(self, build_model: Callable[[], nn.Module], data_loader: Callable[[int], Any] | None
              ) -> tuple[Callable[[], nn.Module], Callable[[int], Any], Callable[[int], Any] | None]:
        """The model file's build_model, example_batch and data_loader, giving positional inputs and a model taking
        them (see the module docstring)."""
        def build() -> nn.Module:
            model = build_model()
            names = self.found()
            return keyword_model(model, names) if names and isinstance(model, nn.Module) else model

        def example(batch_size: int) -> Any:
            return self.positional(self.example_batch(batch_size))

        def loader(batch_size: int) -> Iterable[Any]:
            assert data_loader is not None  # only handed out where the file has one
            return _Positional(self, data_loader(batch_size))

        return build, example, (loader if data_loader is not None else None)


@dataclass
class _Positional:
    """A data loader's batches with their inputs made positional (`KeywordInputs.positional`)."""

    inputs: KeywordInputs
    batches: Iterable[Any]

    def __iter__(self) -> Iterator[Any]:
        return (self.inputs.positional(batch) for batch in self.batches)


def keyword_model(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """`model`, in place, taking its inputs positionally: forward(self, names[0], names[1], ...) calls the model's
    own forward with each by its name. Its class becomes a subclass of the same name (torch.fx and torch.export
    then see one argument per name). InputNamesError where a name is not an argument of the forward; ValueError
    where the model's forward is set on the object (accelerate's hooks do so), which the class's would not
    replace."""
    _check_names(names)
    base = type(model)
    if "forward" in vars(model):
        raise ValueError(f"the {base.__name__}'s forward is set on the model object (as accelerate's hooks set it), so "
                         "its inputs cannot be passed by name: give them as a tuple in the forward's order")
    parameters = inspect.signature(base.forward).parameters
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        named = [name for name, parameter in parameters.items()
                 if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        unknown = [name for name in names if name not in named]
        if unknown:
            raise InputNamesError(f"inputs named {', '.join(unknown)}, which {base.__name__}.forward does not take "
                                  f"(its arguments: {', '.join(name for name in named if name != 'self')})")
    arguments = ", ".join(names)
    source = (f"def forward(self, {arguments}):\n"
              f"    return __forward__(self, {', '.join(f'{name}={name}' for name in names)})\n")
    namespace: dict[str, Any] = {"__forward__": base.forward}
    exec(compile(source, f"<inputs of {base.__name__} by name>", "exec"), namespace)
    forward = namespace["forward"]
    forward.__doc__ = f"{base.__name__}.forward({', '.join(f'{name}=...' for name in names)}), positionally."
    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                   "__qualname__": base.__qualname__, _BASE: base})
    return model


_BASE = "_keyword_inputs_base"  # the class attribute of a `keyword_model` class naming the model's own class


def own_class(model: nn.Module) -> type:
    """The model's class, or where `keyword_model` changed it, the one it had."""
    return vars(type(model)).get(_BASE, type(model))


def without_keyword_inputs(model: nn.Module) -> nn.Module:
    """`model`, in place, with its own class back where `keyword_model` changed it (to pickle it whole, or to
    generate with it); any other model as it is."""
    model.__class__ = own_class(model)
    return model


def _named(batch: Any) -> bool:
    """Whether `batch` is a pair whose inputs are a dict."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], Mapping)


def _check_names(names: tuple[Any, ...]) -> None:
    """InputNamesError naming an input name that is not a Python identifier (the model takes them as arguments)."""
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name == "self" \
                or name.startswith("__"):
            raise InputNamesError(f"an input named {name!r}, which cannot name an argument of forward: name the "
                                  "inputs as the model's forward names its arguments")


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """Torch's CPU generator (and the GPUs' where CUDA is initialised), Python's `random` and (where imported)
    NumPy's global state as they were before."""
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
