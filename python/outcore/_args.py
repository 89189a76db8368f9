"""Checks of the arguments the outcore package passes to its compiled half: integers that are
integers and fit where they go, paths the C library reads as given. Each error is one line
naming the argument and the value."""
import operator
import os


def shown(value):
    """repr(value) on one line, cut to 60 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def integer(value, name, low=None, high=None, allowed=None):
    """value as an int: an int, or an object that is one (operator.index: numpy and torch
    integers), never a bool, a float or a str, which int() would take, round or parse. TypeError
    naming `name` otherwise. With low and high: ValueError naming `name` unless
    low <= value <= high, saying `allowed` (default "an integer in low..high")."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r} (bool)")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {shown(value)} "
                        f"({type(value).__name__})") from None
    if low is not None and not low <= number <= high:
        raise ValueError(f"{name}: got {number}; allowed: "
                         f"{allowed or f'an integer in {low}..{high}'}")
    return number


def path(value, name):
    """os.fspath(value) (a str or bytes), or ValueError naming `name` when it holds a null byte:
    the C library would take the path as ending there and open another file (as open() does)."""
    p = os.fspath(value)
    if ("\0" if isinstance(p, str) else b"\0") in p:
        raise ValueError(f"{name}: {p!r}: embedded null byte")
    return p
