"""What an init changed, read from the tensors (structinit.init.changes): another dtype, another
shape or any value is a change; NaN where NaN was is not; a tensor added or removed is named;
entries that are not tensors are not."""

import torch

from structinit.init.changes import changed, snapshot


def test_a_change_is_any_difference_of_dtype_shape_or_value_and_nan_stays_nan():
    sd = {"a": torch.zeros(3), "b": torch.tensor([1.0, float("nan")]), "c": torch.ones(2, 2), "d": torch.zeros(2),
          "e": torch.arange(4), "gone": torch.ones(1), "note": "not a tensor"}
    before = snapshot(sd)
    assert "note" not in before and changed(before, sd) == []
    sd["a"] = torch.zeros(3, dtype=torch.float64)  # the dtype alone
    sd["b"] = torch.tensor([1.0, float("nan")])  # a new tensor, the same values (NaN where NaN was)
    sd["c"] = torch.ones(4)  # the shape alone (the same values)
    sd["d"][1] = 1e-7  # one value, in place
    sd["e"] = torch.arange(4)  # an integer tensor, equal
    sd["new"] = torch.ones(1)
    del sd["gone"]
    assert changed(before, sd) == ["a", "c", "d", "new", "gone"]
    sd["b"][1] = 0.0  # NaN to a number is a change
    assert "b" in changed(before, sd)
