"""Wire names: wrapper prefixes out, in any nesting; collisions are errors naming both."""

from __future__ import annotations

import pytest
import torch

from diloco.core.names import wire_name, wire_names
from diloco.worker.state.local_model import LocalModel


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("fc.weight", "fc.weight"),
        ("module.fc.weight", "fc.weight"),  # DDP, DataParallel
        ("_orig_mod.fc.weight", "fc.weight"),  # torch.compile
        ("module._orig_mod.fc.weight", "fc.weight"),  # DDP of a compiled model
        ("_orig_mod.module.fc.weight", "fc.weight"),  # a compiled DDP
        ("module.module.fc.weight", "fc.weight"),  # DataParallel of DDP
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.weight", "layers.0.weight"),
        (
            "_fsdp_wrapped_module.h.1._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight",
            "h.1.mlp.weight",
        ),
        ("encoder._orig_mod.layer.weight", "encoder.layer.weight"),  # a compiled submodule
        ("encoder._orig_mod.module.weight", "encoder.weight"),  # DDP inside a compiled part
        # A submodule the user named "module" is theirs, unless a wrapper stands before it.
        ("encoder.module.weight", "encoder.module.weight"),
        ("module.encoder.module.weight", "encoder.module.weight"),
        ("module", "module"),  # nothing left: kept as it is
    ],
)
def test_wire_name_takes_out_wrapper_components(name: str, wire: str) -> None:
    assert wire_name(name) == wire


def test_wire_names_keep_order_and_items() -> None:
    named = [("module.b", 1), ("module.a", 2)]
    assert list(wire_names(named).items()) == [("b", 1), ("a", 2)]


def test_two_names_that_become_one_are_an_error_naming_both() -> None:
    with pytest.raises(ValueError, match=r"'fc.weight' and '_orig_mod.fc.weight' both become"):
        wire_names([("fc.weight", 1), ("_orig_mod.fc.weight", 2)])


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self._orig_mod = torch.nn.Module()
        self._orig_mod.fc = torch.nn.Linear(2, 2)


def test_the_worker_sends_and_expects_wire_names_of_its_own_parameters() -> None:
    inner = torch.nn.Linear(3, 2)
    local = LocalModel(torch.nn.DataParallel(torch.compile(inner)), "F32", {})
    assert local.table() == {"weight": (2, 3), "bias": (2,)}
    assert local.params["weight"] is inner.weight  # the mapping to the real parameters
    assert [s.name for s in local.specs()] == ["weight", "bias"]
    assert set(local.detached()) == {"weight", "bias"}  # what a seeding worker uploads
    local.check_server_table([["weight", [2, 3]], ["bias", [2]]])
    with pytest.raises(ValueError, match="both become 'fc.weight'"):
        LocalModel(Holder(), "F32", {})
