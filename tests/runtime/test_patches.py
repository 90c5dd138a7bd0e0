"""runtime.patches: attributes replaced for a block come back as they were, also when the replacing fails."""

from __future__ import annotations

import pytest

from runtime.patches import Patches


class Base:
    inherited = "base"


class Owner(Base):
    own = "own"


class Failing(Patches):
    def patch(self) -> None:
        self.replace(Owner, "own", "replaced")
        self.replace(Owner, "inherited", "replaced")
        raise RuntimeError("halfway")


def test_replaced_attributes_come_back_and_inherited_ones_are_inherited_again() -> None:
    patches = Patches()
    with patches:
        patches.replace(Owner, "own", 1)
        patches.replace(Owner, "inherited", 2)
        patches.replace(Owner, "own", 3)
        assert (Owner.own, Owner.inherited) == (3, 2)
    assert Owner.__dict__["own"] == "own" and "inherited" not in Owner.__dict__ and Owner.inherited == "base"


def test_a_patch_that_raises_puts_back_what_it_had_replaced() -> None:
    with pytest.raises(RuntimeError, match="halfway"):
        with Failing():
            pass
    assert Owner.own == "own" and "inherited" not in Owner.__dict__
