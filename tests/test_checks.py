"""One home and one wording for the conversion of arguments NumPy refuses.

Every entry point that takes an array turns NumPy's own error on a ragged list into a TypeError
that names the argument, says what was expected and what was given, through
``npattn._checks.converted`` -- whichever layer (functional, modules, optimisers, gradcheck)
the argument reaches first.
"""
import re

import numpy as np
import pytest

import npattn
from npattn import gradcheck, nn, optim

RAGGED = [[1.0, 2.0], [3.0]]            # NumPy >= 1.24 refuses it: inhomogeneous shape
F32 = np.float32


def _linear_input():
    npattn.linear(RAGGED, np.ones((2, 2), F32))


def _sdpa_mask():
    q = np.ones((1, 2, 4), F32)
    npattn.scaled_dot_product_attention(q, q, q, attn_mask=RAGGED)


def _embedding_indices():
    npattn.embedding(RAGGED, np.ones((4, 2), F32))


def _cross_entropy_target():
    npattn.cross_entropy(np.ones((2, 3), F32), RAGGED)


def _parameter_data():
    nn.Parameter(RAGGED)


def _parameter_accumulate():
    nn.Parameter(np.ones(2, F32)).accumulate(RAGGED)


def _module_state_dict():
    layer = nn.Linear(2, 2)
    state = layer.state_dict()
    state["weight"] = RAGGED
    layer.load_state_dict(state)


def _optimizer_grad():
    p = nn.Parameter(np.ones(2, F32))
    p.grad = RAGGED
    optim.SGD([p], lr=0.1).step()


def _optimizer_state():
    p = nn.Parameter(np.ones((2, 2), F32))
    opt = optim.Adam([p])
    p.grad = np.ones((2, 2), F32)
    opt.step()
    state = opt.state_dict()
    first = next(iter(state["state"].values()))
    first["exp_avg"] = RAGGED
    opt.load_state_dict(state)


def _mha_mask():
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    x = np.ones((1, 2, 4), F32)
    mha.forward(x, x, x, key_padding_mask=RAGGED)


def _gradcheck_dout():
    gradcheck.gradcheck(lambda x: x * 2, lambda d, x: (2 * d,), (np.ones(2),), dout=RAGGED)


CASES = {
    "x": _linear_input,
    "attn_mask": _sdpa_mask,
    "indices": _embedding_indices,
    "target": _cross_entropy_target,
    "Parameter data": _parameter_data,
    "grad": _parameter_accumulate,
    "state_dict['weight']": _module_state_dict,
    "a parameter's grad": _optimizer_grad,
    "state 'exp_avg'": _optimizer_state,
    "key_padding_mask": _mha_mask,
    "dout": _gradcheck_dout,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_ragged_argument_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError) as info:
        CASES[name]()
    message = str(info.value)
    argument = name.split(" (")[0]
    assert message.startswith(f"{argument} must be "), message
    assert re.search(r"; got list that NumPy cannot convert \(.+\)$", message), message
