"""Equinox's DCGAN example (`dcgan_example.py`) with its two steps folded into one jitted
step that donates everything (`donate="all"`, the README's recipe), though each model's
`eqx.nn.State` shares arrays with the model."""

import functools

from .dcgan_example import STEPS as STEPS, train as _train


train = functools.partial(_train, donate="all", one_step=True)
