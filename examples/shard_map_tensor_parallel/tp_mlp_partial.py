"""The buggy twin of tp_mlp that forgets the psum: each "model" rank returns its partial output (Megatron's
row-parallel matmul needs the sum over "model")."""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from tp_mlp import init_params, mlp  # noqa: F401  (same model and reference)


def make_parallel_mlp(mesh):
    specs = (P(None, "model"), P("model", None), P("data", None))
    # BUG: no lax.psum(..., "model"): out_specs claims the value is replicated over "model", check_vma=False
    # lets it through, and each device keeps its own partial sum.
    local = jax.jit(jax.shard_map(lambda w1, w2, x: jax.nn.gelu(x @ w1) @ w2, mesh=mesh,
                                  in_specs=specs, out_specs=P("data", None), check_vma=False))

    def parallel(params, x):
        args = (params["w1"], params["w2"], x)
        return local(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)))

    return parallel
