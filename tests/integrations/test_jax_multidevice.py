"""Eight CPU devices in a subprocess: every replica makes the same skip decision, and a
replicated (pmap) state is read, checked and refused on the host as one state."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("jax", reason="multi-device tests need jax")
pytest.importorskip("optax", reason="multi-device tests need optax")

SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import scaler_core as sc
from scaler_core.optax import current_scale, scale_loss, with_loss_scaling
from scaler_core.jax import reduce_found, to_device

assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("d",))
n = 8

# 1. shard_map: a NaN on one device's shard only makes every replica skip.
def local(g, state):
    g, found = sc.unscale(g, state)
    return reduce_found(found, "d")[None], g

sm = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P("d"))))
state = to_device(sc.init())
g = jnp.ones((n, 4)) * 65536.0
flags, _ = sm(g, state)
assert not np.asarray(flags).any()
flags, _ = sm(g.at[5, 2].set(jnp.inf), state)
assert np.asarray(flags).all(), flags

# 2. Global sharded arrays under plain jit: XLA does the reduction.
gs = jax.device_put(g.at[3, 1].set(jnp.nan), NamedSharding(mesh, P("d")))
_, found = jax.jit(sc.unscale)(gs, state)
assert bool(found)

# 3. Many steps with random per-replica faults: replicas stay identical.
tx = with_loss_scaling(optax.adam(1e-2), sc.ScalerConfig(init_scale=2.0**8, growth_interval=3),
                       axis_name="d")

def train(params, opt_state, x, y, fault):
    # Each replica sees a leading axis of 1: its own copy of the state and its batch.
    params, opt_state = jax.tree_util.tree_map(lambda a: a[0], (params, opt_state))
    x, y, fault = x[0], y[0], fault[0, 0]
    def loss(p):
        return scale_loss(jnp.mean((x @ p["w"] - y) ** 2), opt_state)
    grads = jax.lax.pmean(jax.grad(loss)(params), "d")  # data parallel: one mean gradient
    # A fault on this replica only, after the mean: without the OR, replicas would diverge.
    grads = jax.tree_util.tree_map(lambda a: jnp.where(fault, jnp.inf, a), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return jax.tree_util.tree_map(lambda a: a[None], (params, opt_state))

def rep(x):
    return jnp.broadcast_to(x, (n,) + x.shape)

step = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
params = {"w": rep(jnp.ones((3,)))}
opt_state = jax.tree_util.tree_map(rep, tx.init({"w": jnp.ones((3,))}))
rng = np.random.default_rng(0)
skips = 0
for i in range(40):
    x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    fault = jnp.asarray(rng.random(n) < 0.05)
    params, opt_state = step(params, opt_state, x[:, None, :], y[:, None], fault[:, None])
    skips += bool(fault.any())
for leaf in jax.tree_util.tree_leaves((params, opt_state)):
    a = np.asarray(leaf)
    assert all(np.array_equal(r, a[0], equal_nan=True) for r in a), a
assert int(opt_state.scaler.skipped_steps[0]) == skips > 0, (skips, opt_state.scaler)

# 4. pmap: host-side looks read the replicated state as one state, raise a recorded
# failure, and refuse replicas that disagree instead of picking one.
tx = with_loss_scaling(optax.sgd(0.1), sc.ScalerConfig(init_scale=2.0**-125), axis_name="d")

def pstep(params, opt_state, bad):
    g = jnp.where(bad, jnp.inf, 1.0) * jnp.ones(2) * current_scale(opt_state)
    updates, opt_state = tx.update({"w": g}, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

pstep = jax.pmap(pstep, axis_name="d")
params = {"w": jnp.ones((n, 2))}
opt_state = jax.pmap(tx.init)(params)
assert opt_state.scaler.current_scale() == 2.0**-125
assert float(current_scale(opt_state)[0]) == 2.0**-125
assert sc.to_dict(opt_state.scaler)["state"]["scale"] == 2.0**-125
for bad in (False, True, True, False):  # the second overflow collapses: recorded
    params, opt_state = pstep(params, opt_state, jnp.full((n,), bad))
frozen = np.asarray(params["w"])
params, opt_state = pstep(params, opt_state, jnp.zeros((n,), bool))
assert np.array_equal(np.asarray(params["w"]), frozen)
assert np.asarray(opt_state.skipped).all()
for look in (opt_state.scaler.check, opt_state.scaler.current_scale,
             lambda: sc.to_dict(opt_state.scaler), lambda: current_scale(opt_state)):
    try:
        look()
    except sc.ScaleCollapseError as exc:
        assert "device transition recorded" in str(exc), exc
    else:
        raise AssertionError("a recorded collapse on a replicated state was not raised")
import dataclasses
split = dataclasses.replace(opt_state.scaler, failure=opt_state.scaler.failure.at[3].set(0))
try:
    split.check()
except sc.ReplicaMismatchError as exc:
    assert "replica 3" in str(exc) and exc.groups == [[0, 1, 2, 4, 5, 6, 7], [3]], exc
else:
    raise AssertionError("replicas that disagree were read as one")
print("OK", skips)
"""


def test_replicas_share_one_skip_decision(tmp_path: Any) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("OK")
