"""Sharded Adam/AdamW: fp32 master parameters and optimizer states split evenly over all N ranks
(or over each group of G consecutive ranks and replicated across the groups: ``shard_group``).

This is the *optimization phase* of Hydraulis §5.2: the layout is the same for every parallel
strategy. Parameter ``name`` is cut along its shard dimension ``d`` (size ``S``); rank ``r`` owns
``[floor(r*S/N), floor((r+1)*S/N))`` (``hgraph.shard_rule.shard_bounds``, the rule the LNK plans read
too; with shard groups of G ranks, ``r`` is the rank's place in its group and ``N`` is G,
``group_shard_bounds``). A rank may own an empty shard when ``S < N``.

A rank's fp32 masters and both moments live in three flat buffers (one each, the shards of every
parameter side by side; ``params[name]`` etc. are views into them). Two implementations of the update:

* ``"fused"`` (the default): torch's fused Adam/AdamW kernel (``torch._fused_adam_``, CPU and CUDA),
  one call over the views of the shards a step updates. Its bits depend on where an element falls in
  its shard (vector body or tail: FMA or not), so it rounds up to an ulp apart from
  ``torch.optim.Adam`` on ~0.2% of the elements after 5 steps (measured: max 2.4e-7 on values ~1),
  and a resume on another number of ranks is not bitwise the run it continues.
* ``"exact"``: the operation order of ``torch.optim.Adam``'s single-tensor implementation (L2 weight
  decay, or decoupled decay for AdamW), each op on all shards at once (``torch._foreach_*``): every
  element gets the same fp32 arithmetic as the unsharded optimizer, bitwise, on any number of ranks.

Optional clipping by the global gradient norm sums the squared shard norms of all ranks of the shard
group (one all-reduce: each shard counted once, not once per group) and scales like
``torch.nn.utils.clip_grad_norm_``.
``step`` with clipping and ``full_state_dict`` are collective: every rank calls them.

The parameters given may live on the meta device (a model built without allocating it,
``hgraph.runtime.weights``): the shards are then allocated (zeros, on ``device``) and filled by
``load_shards`` from a weight source, which hands over this rank's segment of every parameter.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from hgraph.errors import HGraphError
from hgraph.runtime.comm.order.issue import CollectiveIssuer
from hgraph.shard_rule import ShardLayout, group_shard_bounds, shard_bounds

FUSED, EXACT = "fused", "exact"
IMPLS = (FUSED, EXACT)


NamedParams = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


class ShardedAdam:
    """Adam (``decoupled_weight_decay=False``) or AdamW on this rank's shards of every parameter.

    ``named_parameters``: the full model's parameters (``model.named_parameters()`` or a dict), in the
    same order on every rank; ``shard_dims``: shard dimension per name (default 0); ``shard_group``:
    the shards are cut over groups of this many consecutive ranks and replicated across the groups
    (``--shard-group``; ``None``: over all N ranks); ``group``: the process group of this rank's shard
    group (default: the default group, which is it without ``shard_group``). Each rank keeps fp32
    copies of its shards only.
    """

    #: ``step`` may take disjoint parts of the gradients one after another within one training step
    #: (each parameter keeps its own step count): the executor updates shards as their gradients
    #: arrive when no global-norm clipping needs them all first
    updates_in_parts = True

    def __init__(self, named_parameters: NamedParams, shard_dims: Optional[Mapping[str, int]] = None,
                 rank: int = 0, world_size: int = 1, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
                 max_grad_norm: Optional[float] = None,
                 group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, impl: str = FUSED,
                 shard_group: Optional[int] = None) -> None:
        if not 0 <= rank < world_size:
            raise HGraphError(f"ShardedAdam: rank {rank} is outside world size {world_size}")
        if shard_group is not None and (shard_group < 1 or world_size % shard_group):
            raise HGraphError(f"ShardedAdam: shard group {shard_group} does not divide world size {world_size}")
        # the layout: this rank's place in its shard group of ``group_size`` ranks
        self.shard_group = None if shard_group == world_size else shard_group
        self.group_size = shard_group or world_size
        self.group_rank = rank % self.group_size
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise HGraphError(f"ShardedAdam: invalid hyper-parameters lr={lr}, betas={betas}, "
                              f"eps={eps}, weight_decay={weight_decay}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise HGraphError(f"ShardedAdam: max_grad_norm must be > 0, got {max_grad_norm}")
        if impl not in IMPLS:
            raise HGraphError(f"ShardedAdam: implementation {impl!r}; allowed: {', '.join(IMPLS)}")
        self.impl = impl
        self.rank, self.world_size, self.group = rank, world_size, group
        # the rank's choke point for the step's norm reduction (the executor hands it its own)
        self.issuer = CollectiveIssuer(rank, world_size)
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.weight_decay, self.decoupled_weight_decay = weight_decay, decoupled_weight_decay
        self.max_grad_norm = max_grad_norm
        items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
        shard_dims = dict(shard_dims or {})
        self.layouts: dict[str, ShardLayout] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.steps: dict[str, float] = {}
        items = list(items)
        for name, p in items:
            self.layouts[name] = self._layout(name, tuple(p.shape), shard_dims.pop(name, 0))
        if shard_dims:
            raise HGraphError(f"ShardedAdam: shard dims given for unknown parameters {sorted(shard_dims)}")
        devices = {torch.device(device) if device is not None
                   else (torch.device("cpu") if p.is_meta else p.device) for _, p in items}
        if len(devices) > 1:
            raise HGraphError(f"ShardedAdam: parameters on several devices {sorted(map(str, devices))}; "
                              "give device=")
        where = devices.pop() if devices else torch.device(device or "cpu")
        numel = sum(math.prod(lay.shard_shape) for lay in self.layouts.values())
        self.flat_params, self.flat_exp_avg, self.flat_exp_avg_sq = (
            torch.zeros(numel, dtype=torch.float32, device=where) for _ in range(3))
        offset = 0
        for name, p in items:
            layout = self.layouts[name]
            n = math.prod(layout.shard_shape)
            master = self.flat_params[offset:offset + n].view(layout.shard_shape)
            if not p.is_meta:       # a meta parameter is filled by load_shards
                master.copy_(layout.slice_of(p.detach()))
            self.params[name] = master
            self.exp_avg[name] = self.flat_exp_avg[offset:offset + n].view(layout.shard_shape)
            self.exp_avg_sq[name] = self.flat_exp_avg_sq[offset:offset + n].view(layout.shard_shape)
            self.steps[name] = 0.0
            offset += n

    def issue_through(self, issuer: CollectiveIssuer) -> None:
        """Issue the norm's reduction through ``issuer`` (the executor's: one order and record a rank)."""
        self.issuer = issuer

    def _layout(self, name: str, shape: tuple[int, ...], dim: int) -> ShardLayout:
        ndim = max(len(shape), 1)
        if not -ndim <= dim < ndim:
            raise HGraphError(f"ShardedAdam: shard dim {dim} of parameter {name!r} is out of range "
                              f"for shape {list(shape)}")
        dim %= ndim
        size = shape[dim] if shape else 1
        lo, hi = group_shard_bounds(size, self.rank, self.group_size)
        return ShardLayout(name, shape, dim, lo, hi)

    # ---- the update ------------------------------------------------------------------------------
    def _checked_grads(self, grad_shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        grads = {}
        for name, g in grad_shards.items():
            layout = self.layouts.get(name)
            if layout is None:
                raise HGraphError(f"ShardedAdam.step: gradient for unknown parameter {name!r}")
            if tuple(g.shape) != layout.shard_shape:
                raise HGraphError(f"ShardedAdam.step: gradient shard of {name!r} has shape "
                                  f"{list(g.shape)}, rank {self.rank} owns {list(layout.shard_shape)}")
            grads[name] = g.detach().to(torch.float32)
        return grads

    def global_grad_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all gradients of all ranks (collective: one all-reduce). The shards' norms
        come from one multi-tensor call (on CUDA a few kernels per step, where a norm, a cast, a
        square and an add per shard launched four each), summed squared in float64. With shard
        groups the sum runs inside this rank's group, which holds every shard once (every group
        holds the same gradients after the push, so each computes the same norm)."""
        shards = list(grads.values())
        local = (torch.stack(torch._foreach_norm(shards, 2)).double().square().sum() if shards
                 else torch.zeros((), dtype=torch.float64, device=self.flat_params.device))
        if self.group_size > 1:
            self.issuer.run("all_reduce", self.group, local,
                            lambda: dist.all_reduce(local, group=self.group, async_op=True), "grad norm")
        return local.sqrt().to(torch.float32)

    @torch.no_grad()
    def step(self, grad_shards: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """One Adam/AdamW step on the shards that have a gradient (others are skipped, as torch does).

        Returns the global gradient norm before clipping when ``max_grad_norm`` is set, else None.
        """
        grads = self._checked_grads(grad_shards)
        total_norm = None
        if self.max_grad_norm is not None:
            total_norm = self.global_grad_norm(grads)
            clip_coef = torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)
            grads = dict(zip(grads, torch._foreach_mul(list(grads.values()), clip_coef)))
        if grads:
            (self._fused_update if self.impl == FUSED else self._update)(grads)
        return total_norm

    def _fused_update(self, grads: Mapping[str, torch.Tensor]) -> None:
        """torch's fused Adam/AdamW kernel on the updated shards (views into the flat buffers), one call
        per step count. Per shard, not on the whole flat buffer: an element's bits then do not depend
        on which other shards a call updates, so the overlapped update (shards in parts, as their
        reductions arrive) equals one update of them all to the bit."""
        by_step: dict[float, list[str]] = {}
        for name in grads:
            by_step.setdefault(self.steps[name], []).append(name)
        kernel = torch._fused_adamw_ if self.decoupled_weight_decay else torch._fused_adam_
        for step, names in by_step.items():
            for n in names:
                self.steps[n] = step + 1
            names = [n for n in names if grads[n].numel()]
            if not names:
                continue
            params = [self.params[n] for n in names]
            # one fill for every shard's step count (a tensor each from the host would wait for the GPU)
            steps = list(torch.full((len(names),), step + 1, dtype=torch.float32, device=params[0].device).unbind())
            # the kernel walks memory linearly: a shard cut from a gradient along dim > 0 is strided
            kernel(params, [grads[n].contiguous() for n in names], [self.exp_avg[n] for n in names],
                   [self.exp_avg_sq[n] for n in names], [], steps, amsgrad=False, lr=self.lr,
                   beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay, eps=self.eps,
                   maximize=False)

    def _update(self, grads: Mapping[str, torch.Tensor]) -> None:
        """torch's ``_single_tensor_adam`` operation for operation, each op applied to all shards at
        once (``torch._foreach_*``: the same per-element arithmetic, one call instead of one per shard).
        Not torch's fused Adam kernel, though 3-4x faster on CPU: its bits depend on where an element
        falls in the shard (vector body or tail), so a run would stop being bitwise independent of
        the world size (a resharded resume, ``test_checkpoint_local``)."""
        beta1, beta2 = self.betas
        lr, wd = self.lr, self.weight_decay
        names = list(grads)
        params = [self.params[n] for n in names]
        exp_avgs = [self.exp_avg[n] for n in names]
        exp_avg_sqs = [self.exp_avg_sq[n] for n in names]
        g = [grads[n] for n in names]
        for n in names:
            self.steps[n] += 1
        if wd != 0:
            if self.decoupled_weight_decay:
                torch._foreach_mul_(params, 1 - lr * wd)
            else:
                g = torch._foreach_add(g, params, alpha=wd)
        torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1 - beta2)
        step_sizes, bc2_sqrts = [], []
        for n in names:
            step = self.steps[n]
            step_sizes.append(-(lr / (1 - beta1 ** step)))
            bc2_sqrts.append((1 - beta2 ** step) ** 0.5)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrts)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    # ---- state ------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The fp32 parameters gathered to full tensors, keyed by name (collective in this rank's shard
        group: every group holds them all).

        With ``rank0_only`` only rank 0 receives them; the other ranks get ``{}``.
        """
        out = {}
        if rank0_only and self.rank >= self.group_size:
            return out                    # another shard group than rank 0's: nothing to take part in
        for name, layout in self.layouts.items():
            full = self._gather_full(layout, self.params[name], rank0_only)
            if full is not None:
                out[name] = full
        return out

    def _gather_full(self, layout: ShardLayout, shard: torch.Tensor,
                     rank0_only: bool) -> Optional[torch.Tensor]:
        size = layout.full_shape[layout.dim] if layout.full_shape else 1
        if self.group_size == 1:
            return shard.reshape(layout.full_shape).clone()
        width = math.ceil(size / self.group_size)  # the widest shard: pad every shard to it
        padded = list(layout.shard_shape)
        padded[layout.dim] = width
        inp = shard.new_zeros(padded)
        inp.narrow(layout.dim, 0, shard.shape[layout.dim]).copy_(shard)
        pieces = [torch.empty_like(inp) for _ in range(self.group_size)]
        if rank0_only:
            dist.gather(inp, pieces if self.rank == 0 else None, dst=0, group=self.group)
            if self.rank != 0:
                return None
        else:
            dist.all_gather(pieces, inp, group=self.group)
        parts = []
        for r, piece in enumerate(pieces):
            lo, hi = shard_bounds(size, r, self.group_size)
            parts.append(piece.narrow(layout.dim, 0, hi - lo))
        return torch.cat(parts, dim=layout.dim).reshape(layout.full_shape)

    @torch.no_grad()
    def load_full_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Set the master shards from full parameters (e.g. a checkpoint written with another N)."""
        for name, layout in self.layouts.items():
            if name not in full:
                raise HGraphError(f"ShardedAdam.load_full_state_dict: parameter {name!r} is missing")
            if tuple(full[name].shape) != layout.full_shape:
                raise HGraphError(f"ShardedAdam.load_full_state_dict: {name!r} has shape "
                                  f"{list(full[name].shape)}, expected {list(layout.full_shape)}")
            self.params[name].copy_(layout.slice_of(full[name]))

    @torch.no_grad()
    def load_shards(self, shards: Iterable[tuple[str, torch.Tensor]], source: str = "the weights") -> None:
        """Set every master shard from ``(name, this rank's segment)`` pairs (a weight source's
        ``shards(self.layouts)``); a name missing, unknown or of the wrong shape is an error naming ``source``."""
        seen = set()
        for name, shard in shards:
            layout = self.layouts.get(name)
            if layout is None:
                raise HGraphError(f"{source}: {name!r} is not a parameter of the model")
            if tuple(shard.shape) != layout.shard_shape:
                raise HGraphError(f"{source}: {name!r} segment has shape {list(shard.shape)}, rank {self.rank} "
                                  f"owns {list(layout.shard_shape)} of {list(layout.full_shape)}")
            self.params[name].copy_(shard)
            seen.add(name)
        missing = [n for n in self.layouts if n not in seen]
        if missing:
            raise HGraphError(f"{source}: no value for {len(missing)} parameter(s) of the model, first {missing[:3]}")

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards of parameters and moments, steps and hyper-parameters (copies)."""
        def copy(d: dict) -> dict:
            return {k: v.clone() for k, v in d.items()}
        return {"rank": self.rank, "world_size": self.world_size, "shard_group": self.shard_group,
                "shard_dims": {n: lay.dim for n, lay in self.layouts.items()},
                "hyper": {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                          "weight_decay": self.weight_decay,
                          "decoupled_weight_decay": self.decoupled_weight_decay,
                          "max_grad_norm": self.max_grad_norm},
                "steps": dict(self.steps), "params": copy(self.params),
                "exp_avg": copy(self.exp_avg), "exp_avg_sq": copy(self.exp_avg_sq)}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` written by the same rank of a run with the same world size."""
        saved_group = state.get("shard_group") or state["world_size"]
        if (state["rank"] % saved_group, saved_group) != (self.group_rank, self.group_size):
            raise HGraphError(f"ShardedAdam.load_state_dict: state of rank {state['rank']} of "
                              f"{state['world_size']} (shard group {saved_group}) cannot load into rank "
                              f"{self.rank} of {self.world_size} (shard group {self.group_size}); use "
                              "load_full_state_dict to re-shard")
        if set(state["params"]) != set(self.layouts):
            raise HGraphError("ShardedAdam.load_state_dict: parameter names differ: "
                              f"{sorted(set(state['params']) ^ set(self.layouts))}")
        for name, layout in self.layouts.items():
            if state["shard_dims"][name] != layout.dim:
                raise HGraphError(f"ShardedAdam.load_state_dict: {name!r} was sharded along dim "
                                  f"{state['shard_dims'][name]}, this optimizer uses {layout.dim}")
            for key, target in (("params", self.params), ("exp_avg", self.exp_avg),
                                ("exp_avg_sq", self.exp_avg_sq)):
                src = state[key][name]
                if tuple(src.shape) != layout.shard_shape:
                    raise HGraphError(f"ShardedAdam.load_state_dict: {key}[{name!r}] has shape "
                                      f"{list(src.shape)}, expected {list(layout.shard_shape)}")
                target[name].copy_(src)
        hyper = state["hyper"]
        self.lr, self.betas, self.eps = hyper["lr"], tuple(hyper["betas"]), hyper["eps"]
        self.weight_decay = hyper["weight_decay"]
        self.decoupled_weight_decay = hyper["decoupled_weight_decay"]
        self.max_grad_norm = hyper["max_grad_norm"]
        self.steps = {name: float(state["steps"][name]) for name in self.layouts}


class ShardedAdamW(ShardedAdam):
    """``ShardedAdam`` with decoupled weight decay (``torch.optim.AdamW``; default decay 1e-2)."""

    def __init__(self, named_parameters: NamedParams, shard_dims: Optional[Mapping[str, int]] = None,
                 rank: int = 0, world_size: int = 1, *, weight_decay: float = 1e-2,
                 **kwargs: Any) -> None:
        super().__init__(named_parameters, shard_dims, rank, world_size, weight_decay=weight_decay,
                         decoupled_weight_decay=True, **kwargs)
