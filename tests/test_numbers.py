"""The one rule for counts, sizes and durations given as arguments (runtime/numbers.py)."""

import numpy as np
import pytest
import torch

from runtime.numbers import check_number, check_whole, is_number, is_whole


@pytest.mark.parametrize("value, whole", [
    (3, True), (np.int64(3), True), (np.uint8(3), True), (0, False), (True, False), (np.True_, False),
    (3.0, False), (np.float64(3), False), ("3", False), (None, False), (10**40, True),
    (np.array(3), False), (torch.tensor(3), False)])  # torch.set_num_threads takes neither
def test_a_whole_number_is_an_integer_of_any_kind_but_a_bool(value, whole):
    assert is_whole(value, 1) is whole


@pytest.mark.parametrize("value, number", [
    (0.5, True), (np.float32(0.5), True), (2, True), (np.int64(2), True), (float("nan"), False),
    (float("inf"), False), (10**400, False), (True, False), ("1", False), (None, False), (-1, False)])
def test_a_number_is_finite_and_real(value, number):
    assert is_number(value, 0) is number


def test_the_floor_is_kept_or_passed():
    assert is_number(0, 0) and not is_number(0, 0, above=True) and is_number(1e-9, 0, above=True)
    with pytest.raises(ValueError, match=r"^poll_interval_s must be a number > 0, got 0$"):
        check_number("poll_interval_s", 0, 0, above=True)
    with pytest.raises(ValueError, match=r"^max_in_flight must be a whole number >= 1, got np.int64\(0\)$"):
        check_whole("max_in_flight", np.int64(0), 1)


def test_the_beam_face_takes_numpy_counts(tmp_path):
    """A count read from a numpy-typed config was refused with "must be an integer >= 1, got 2"."""
    from batchgen_beam import BatchGenModelHandler, Generate

    generate = Generate(str(tmp_path), num_shards=np.int64(2), max_in_flight=np.int32(8))
    assert generate is not None
    BatchGenModelHandler(str(tmp_path), min_batch_size=np.int64(2), max_batch_size=np.int64(4))
