"""Attention masks without padding (planner.profiling.attention_masks): found by the forward's names, noted by the
profile."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from planner.display.tables import profile_summary
from planner.profiling.attention_masks import masks_without_padding
from planner.profiling.keyword_inputs import keyword_model
from planner.profiling.model_file import load_model_file
from planner.profiling.profiler import ProfileSettings, profile_model


class Masked(nn.Module):
    """Token embeddings zeroed where a mask is 0; no mask: none zeroed, as in transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        for mask in (attention_mask, decoder_attention_mask):
            h = h if mask is None else h * mask[..., None]
        return self.head(h)


class NeedsTheMask(Masked):
    """A forward that cannot go without its mask."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, attention_mask)


IDS = torch.randint(0, 16, (2, 5))
ONES = torch.ones(2, 5, dtype=torch.long)
PADDED = ONES.clone().index_fill_(1, torch.tensor([4]), 0)


def test_masks_of_ones_are_named_by_the_forwards_arguments() -> None:
    assert masks_without_padding(Masked(), (IDS, ONES)) == ("attention_mask",)
    assert masks_without_padding(Masked(), (IDS, ONES.float(), ONES.bool())) == ("attention_mask",
                                                                                 "decoder_attention_mask")
    assert masks_without_padding(Masked(), (IDS, PADDED, ONES)) == ("decoder_attention_mask",)
    assert masks_without_padding(Masked(), (ONES, PADDED)) == ()  # ones that are not a mask: ids of token 1
    assert masks_without_padding(NeedsTheMask(), (IDS, ONES)) == ()  # no mask to leave out



def test_inputs_given_by_name_are_named_as_given() -> None:
    """A model made to take its inputs by name in another order (`keyword_model`) is read by its own forward."""
    model = keyword_model(Masked(), ("attention_mask", "input_ids"))
    assert masks_without_padding(model, (ONES, IDS)) == ("attention_mask",)
    assert masks_without_padding(model, (PADDED, IDS)) == ()
    assert masks_without_padding(keyword_model(NeedsTheMask(), ("attention_mask", "input_ids")), (ONES, IDS)) == ()


def test_a_forward_of_any_arguments_names_none() -> None:
    class Any_(nn.Module):
        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return sum(tensors)

    assert masks_without_padding(Any_(), (ONES, ONES)) == ()


MODEL_FILE = '''
import torch
from tests.planner.profiling.test_attention_masks import Masked


def build_model():
    return Masked()


def example_batch(batch_size):
    ids = torch.randint(0, 16, (batch_size, 6))
    return {{"input_ids": ids[:, :-1], "attention_mask": {mask}}}, ids[:, 1:]
'''


def test_a_profile_notes_a_mask_without_padding_and_not_a_padded_one(tmp_path: Path) -> None:
    notes = []
    for name, mask in (("ones", "torch.ones(batch_size, 5)"), ("padded", "torch.arange(5).expand(batch_size, 5) < 4")):
        (tmp_path / f"{name}.py").write_text(MODEL_FILE.format(mask=mask))
        profile = profile_model(load_model_file(tmp_path / f"{name}.py"),
                                ProfileSettings(batch_size=2, warmup=0, iters=1, min_seconds=0, threads=1, processes=1))
        notes.append([line for line in profile_summary(profile).splitlines() if "all ones" in line])
        assert profile.settings.get("masks_without_padding") == (["attention_mask"] if name == "ones" else None)
    assert notes[0] == ["note: example_batch() gives attention_mask of all ones (no padding): leave it out where "
                        "batches are not padded, as transformers' attention then runs the same; a split stage cannot "
                        "look at a mask's values, so it keeps one with its layers and sends it on (memory this "
                        "profile did not measure where eager attention drops it), and on a GPU attention cannot use "
                        "its flash kernel"]
    assert notes[1] == []
