"""The checks every argument of a count, a size or a duration gets, wherever it is taken (the
engine, the pool, the Beam glue, a config): one rule, one wording."""

import math
import numbers


def is_whole(value, floor: int) -> bool:
    """value is an integer, Python's or numpy's, at least floor. Never a bool (True is 1 to
    Python, not a count), a float (2.0 may be a rounded 2.4), nor an array or tensor of one
    element (torch.set_num_threads takes no np.array(1))."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= floor


def is_number(value, floor: float, *, above: bool = False) -> bool:
    """value is a finite real number (numpy's too; not a bool) at least floor, or past it where
    above."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False
    return finite and bool(value > floor if above else value >= floor)  # numpy's compare to np.bool_


def python_number(value):
    """A number of numpy's (or of any other numbers.Real type) as the Python int or float it
    holds, so that what keeps it hashes, pickles and prints as plain numbers do; anything else,
    bools included, as it is, for a check to judge."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return float(value)
    except OverflowError:  # a Fraction past float's range: a check refuses it as it is
        return value


def check_whole(name: str, value, floor: int) -> None:
    if not is_whole(value, floor):
        raise ValueError(f"{name} must be a whole number >= {floor}, got {value!r}")


def check_number(name: str, value, floor: float, *, above: bool = False) -> None:
    if not is_number(value, floor, above=above):
        raise ValueError(f"{name} must be a number {'>' if above else '>='} {floor}, got {value!r}")
