"""Mixture-of-experts blocks as people write them -> hgraph's MoE op (``hgraph.moe.moe_layer``).

MoE code routes tokens with data-dependent control flow (``if token.numel() == 0: continue``, a loop
over ``expert_hit.nonzero()``, ``torch.where`` of the routing mask) that neither torch.fx nor
torch.export traces. So before tracing, as attention forms are recognised after it, each MoE block is
found by its structure and, while the frontend traces, its ``forward`` is replaced by one that calls
hgraph's op on the block's own parameters (their names do not change):

* **experts**: a child ``nn.ModuleList`` of at least two SwiGLU MLPs (three bias-free Linears,
  ``down(silu(gate(x)) * up(x))``, which Linear is which read from a run of the first expert), or
  Hugging Face 5.x's fused experts (a child with ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
  parameters and a SiLU ``act_fn``);
* **router**: a child whose 2-D ``weight`` is ``[E, H]`` (an ``nn.Linear`` or HF's router module), whose
  output the block's forward feeds to a softmax and then a top-k: read from a run of the block's forward
  on a fake tensor (``FakeTensorMode``: no memory, works for a model on the meta device) up to its first
  data-dependent step. That run gives ``k`` (the ``topk``'s argument) and whether the top-k weights are
  renormalised (divided by their sum);
* **shared experts** (optional): any other child is a SwiGLU MLP every token runs, added to the routed
  output, optionally scaled by ``sigmoid`` of a ``Linear(H, 1)`` child (Qwen2-MoE's
  ``shared_expert_gate``).

Where the block's parameters hold values (not the meta device), the replacement's output is checked
against the block's own on a small seeded example, so a block that routes or combines otherwise is
refused instead of silently computing something else. A module that looks like an MoE block (a list
of experts, or fused expert weights) but is not recognised gets one line naming the module and what
was missing.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from hgraph import moe
from hgraph.errors import TraceError

_SOFTMAX = {"softmax", "_softmax"}
_DIVIDE = {"div", "div_", "__truediv__", "__itruediv__", "true_divide", "truediv"}
_CASTS = {"to", "float", "type_as", "__get__"}
_CHECK_ELEMENTS = 50_000_000        # blocks up to this many parameter elements are checked on an example


@dataclass(frozen=True)
class MoEForm:
    """What a recognised block computes: its path, router weight, expert weights (``moe_layer``'s
    layout), ``top_k``, renormalisation, and the shared experts (modules, optional sigmoid gate).

    Weights are held as (module, attribute name) and read when the block runs: a frontend may put other
    tensors in a module's place while it traces (another dtype, the meta device)."""

    path: str
    router_at: tuple[nn.Module, str]
    experts_at: tuple[tuple[nn.Module, str], ...]
    top_k: int
    normalize_top_k: bool
    shared: tuple = ()
    shared_gate: Optional[nn.Linear] = None

    @property
    def router(self) -> torch.Tensor:
        return getattr(*self.router_at)

    @property
    def experts(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(m, name) for m, name in self.experts_at)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The block's output from hgraph's op (and the shared experts, traced as ordinary code)."""
        y = moe.moe_layer(x, self.router, *self.experts, top_k=self.top_k, normalize_top_k=self.normalize_top_k)
        if self.shared:                  # on x as it is (no flattening: each token's features alone)
            shared = self.shared[0](x)
            for extra in self.shared[1:]:
                shared = shared + extra(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            y = y + shared
        return y


class _Recorder(TorchFunctionMode):
    """Records every torch function a forward calls: (name, args, kwargs, result)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, dict, Any]] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((getattr(func, "__name__", str(func)), args, kwargs, out))
        return out


def _record(module: nn.Module, width: int, device: torch.device, dtype: torch.dtype) -> list:
    """The torch calls ``module`` makes on a fake ``[1, 4, width]`` input, up to its first step that
    needs values (a data-dependent shape or branch), which ends the run."""
    recorder = _Recorder()
    quiet = logging.root.manager.disable
    logging.disable(logging.ERROR)          # fake kernels log the data-dependent step that ends the run
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1, 4, width, device=device, dtype=dtype)
        with recorder:
            try:
                module(x)
            except Exception:          # the data-dependent step: what was recorded before it is enough
                pass
            finally:
                logging.disable(quiet)
    return recorder.calls


def _produced_from(value: Any, source: Any, calls: list) -> bool:
    """Whether ``value`` is ``source`` or a cast / view of it (through recorded calls)."""
    by_out = {id(out): (name, args) for name, args, _, out in calls if isinstance(out, torch.Tensor)}
    for _ in range(8):
        if value is source:
            return True
        step = by_out.get(id(value))
        if step is None or not step[1] or step[0] not in _CASTS | {"reshape", "view", "contiguous"}:
            return False
        value = step[1][0]
    return False


def _linear_weights(calls: list) -> list[tuple[Any, Any, Any]]:
    """(input, weight, output) of each ``F.linear`` call recorded."""
    return [(args[0], args[1] if len(args) > 1 else kw.get("weight"), out)
            for name, args, kw, out in calls if name == "linear"]


def _swiglu(mlp: nn.Module, width: int, device: torch.device, dtype: torch.dtype
            ) -> Optional[tuple[nn.Parameter, nn.Parameter, nn.Parameter]]:
    """(gate, up, down) weights of a SwiGLU MLP ``down(silu(gate(x)) * up(x))`` without biases, else None."""
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    if len(linears) != 3 or any(m.bias is not None for m in linears) or \
            sum(p.numel() for p in mlp.parameters()) != sum(m.weight.numel() for m in linears):
        return None
    calls = _record(mlp, width, device, dtype)
    lin = _linear_weights(calls)
    silu = [(args[0], out) for name, args, _, out in calls if name == "silu"]
    if len(lin) != 3 or len(silu) != 1:
        return None
    gate = next((w for _, w, out in lin if _produced_from(silu[0][0], out, calls)), None)
    down = lin[-1][1]
    up = next((w for _, w, _ in lin if w is not gate and w is not down), None)
    if gate is None or up is None or gate is down:
        return None
    return gate, up, down


def _is_silu(act: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the activation module ``act`` computes ``F.silu`` (read from a fake run)."""
    if not isinstance(act, nn.Module):
        return False
    return [name for name, *_ in _record(act, 4, device, dtype)] == ["silu"]


def _fused_experts(module: nn.Module) -> Optional[tuple[nn.Parameter, nn.Parameter]]:
    """(gate_up [E, 2I, H], down [E, H, I]) of Hugging Face 5.x's fused experts with a SiLU, else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return None
    if len(list(module.parameters())) != 2:
        return None                    # biases, or more than the two matrices
    return gate_up, down


def _expert_count(child: nn.Module) -> int:
    """How many experts ``child`` holds as a list of alike modules with Linears or fused weights (0: none)."""
    if isinstance(child, nn.ModuleList) and len(child) >= 2 and all(type(m) is type(child[0]) for m in child):
        linears = [m for m in child[0].modules() if isinstance(m, nn.Linear)]
        return len(child) if len(linears) >= 2 else 0
    gate_up = getattr(child, "gate_up_proj", None)
    if isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3 and isinstance(getattr(child, "down_proj", None),
                                                                               nn.Parameter):
        return gate_up.shape[0]
    return 0


def _looks_like_moe(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(child name, experts child) when ``module`` holds experts (a list of alike MLPs, or fused expert
    weights) beside a child whose 2-D weight has one row per expert (a router)."""
    for name, child in module.named_children():
        num = _expert_count(child)
        if num and any(n != name and isinstance(getattr(c, "weight", None), nn.Parameter) and c.weight.dim() == 2
                       and c.weight.shape[0] == num for n, c in module.named_children()):
            return name, child
    return None


def _where(path: str, module: nn.Module) -> str:
    return f"module '{path}' ({type(module).__name__})" if path else f"the top-level {type(module).__name__}"


def recognise(path: str, block: nn.Module, found: tuple[str, nn.Module]) -> MoEForm:
    """The MoEForm of ``block`` (whose experts child is ``found``); one-line TraceError when it is not one."""
    what = _where(path, block)
    experts_name, experts = found
    first = next(block.parameters())
    device, dtype = first.device, first.dtype
    if isinstance(experts, nn.ModuleList):
        num = len(experts)
        width = next(m for m in experts[0].modules() if isinstance(m, nn.Linear)).in_features
        first = _swiglu(experts[0], width, device, dtype)
        if first is None:
            raise TraceError(f"{what} looks like a mixture of experts ({num} experts in '{experts_name}') but expert "
                             "0 is not a SwiGLU MLP (three Linears without bias, down(silu(gate(x)) * up(x))); "
                             "hgraph's MoE op runs SwiGLU experts")
        # the experts are one class (``_expert_count``): each plays its roles with the parameters of the
        # same names, read off the first one's run (one fake run, not one per expert)
        names = {id(p): n for n, p in experts[0].named_parameters()}
        roles = [names[id(w)] for w in first]
        params = [dict(e.named_parameters()) for e in experts]
        bad = [i for i, p in enumerate(params) if set(p) != set(names.values())
               or any(p[r].shape != getattr(first[j], "shape", None) for j, r in enumerate(roles))]
        if bad:
            raise TraceError(f"{what} looks like a mixture of experts ({num} experts in '{experts_name}') but expert "
                             f"{bad[0]}'s parameters differ from expert 0's; hgraph's MoE op runs alike experts")
        weights = tuple(p[roles[j]] for j in range(3) for p in params)
    else:
        fused = _fused_experts(experts)
        act = getattr(experts, "act_fn", None)
        if fused is None or not _is_silu(act, device, dtype):
            raise TraceError(f"{what} looks like a mixture of experts (fused expert weights in '{experts_name}') but "
                             "they are not gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases and a SiLU "
                             "act_fn; hgraph's MoE op runs SwiGLU experts")
        num, width = fused[0].shape[0], fused[0].shape[2]
        weights = fused
    routers = [(n, c) for n, c in block.named_children() if n != experts_name
               and isinstance(getattr(c, "weight", None), nn.Parameter) and tuple(c.weight.shape) == (num, width)]
    if len(routers) != 1:
        raise TraceError(f"{what} looks like a mixture of experts ({num} experts in '{experts_name}') but has "
                         f"{'no' if not routers else 'more than one'} router (a child whose weight is "
                         f"[{num}, {width}]: a Linear from the hidden size to the experts)")
    router_name, router = routers[0]
    if router.weight.dtype != dtype:
        dtype = router.weight.dtype
    top_k, normalize = _routing(block, router.weight, width, device, dtype, what)
    shared, gate = [], None
    for name, child in block.named_children():
        if name in (experts_name, router_name) or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, nn.Linear) and child.out_features == 1 and child.in_features == width and gate is None:
            gate = child
        elif _swiglu(child, width, device, dtype) is not None:
            shared.append(child)
        else:
            raise TraceError(f"{what} looks like a mixture of experts but its child '{name}' "
                             f"({type(child).__name__}) is neither a shared SwiGLU expert nor a Linear(hidden, 1) "
                             "gate of the shared experts; hgraph does not know what it computes")
    if gate is not None and not shared:
        raise TraceError(f"{what}: a Linear(hidden, 1) child without shared experts to gate")
    owners = {id(p): (m, n) for m in block.modules() for n, p in m.named_parameters(recurse=False)}
    return MoEForm(path, (router, "weight"), tuple(owners[id(w)] for w in weights), top_k, normalize, tuple(shared),
                   gate)


def _routing(block: nn.Module, router: nn.Parameter, width: int, device: torch.device, dtype: torch.dtype,
             what: str) -> tuple[int, bool]:
    """(k, renormalised) of the router's logits -> softmax -> top-k, read from a fake run of the block."""
    calls = _record(block, width, device, dtype)
    logits = next((out for _, w, out in _linear_weights(calls) if w is router), None)
    if logits is None:
        raise TraceError(f"{what} looks like a mixture of experts but its forward never applies the router weight "
                         "with a linear (F.linear / nn.Linear) before its first data-dependent step")
    softmax = next((out for name, args, _, out in calls
                    if name in _SOFTMAX and args and _produced_from(args[0], logits, calls)), None)
    if softmax is None:
        raise TraceError(f"{what} looks like a mixture of experts but the router's logits do not go to a softmax "
                         "(a sigmoid router, or top-k before softmax?); hgraph's MoE op routes by top-k of the "
                         "softmax probabilities")
    topk = next(((args, kw, out) for name, args, kw, out in calls
                 if name == "topk" and args and _produced_from(args[0], softmax, calls)), None)
    if topk is None:
        raise TraceError(f"{what} looks like a mixture of experts but the router's softmax does not go to a "
                         "torch.topk; hgraph's MoE op routes each token to the top-k experts by probability")
    args, kw, out = topk
    k = args[1] if len(args) > 1 else kw.get("k")
    dim = args[2] if len(args) > 2 else kw.get("dim", -1)
    if not isinstance(k, int) or dim not in (-1, 1) or kw.get("largest", True) is not True:
        raise TraceError(f"{what}: the router's top-k ({args[1:]}, {kw}) is not a constant k over the experts")
    values = out[0]
    normalize = any(name in _DIVIDE and a and a[0] is values for name, a, _, _ in calls)
    return k, normalize


@contextlib.contextmanager
def swapped_moe_blocks(model: nn.Module) -> Iterator[list[MoEForm]]:
    """While tracing: every MoE block of ``model`` computes through ``hgraph.moe.moe_layer`` (its
    ``forward`` replaced on the instance, restored on exit); yields the recognised forms."""
    forms: list[tuple[nn.Module, MoEForm]] = []
    inside: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in inside:
            continue
        found = _looks_like_moe(module)
        if found is None:
            continue
        form = recognise(path, module, found)
        _check(module, form)
        forms.append((module, form))
        inside.update(id(m) for m in module.modules())
    saved = [(m, m.__dict__.get("forward")) for m, _ in forms]
    try:
        for m, form in forms:
            m.forward = form.forward
        yield [f for _, f in forms]
    finally:
        for m, old in saved:
            if old is None:
                del m.forward
            else:
                m.forward = old


def _check(block: nn.Module, form: MoEForm) -> None:
    """On a seeded example, the replacement computes what the block computes (when its weights hold values)."""
    params = list(block.parameters())
    if any(p.device.type == "meta" for p in params) or sum(p.numel() for p in params) > _CHECK_ELEMENTS:
        return
    g = torch.Generator().manual_seed(0)
    width = form.router.shape[1]
    x = torch.randn(1, 7, width, generator=g).to(device=params[0].device, dtype=form.router.dtype)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = form.forward(x)
    tol = 1e-4 if x.dtype == torch.float32 else 3e-2
    # a token whose k-th and (k+1)-th probabilities nearly tie may choose either when the block computes
    # its logits in another order: such tokens are left out of the comparison
    probs = torch.softmax(torch.nn.functional.linear(x.reshape(-1, width), form.router.detach()).float(), -1)
    top = torch.topk(probs, min(form.top_k + 1, probs.shape[-1]), -1).values
    clear = (top[:, form.top_k - 1] - top[:, -1] > tol) if top.shape[-1] > form.top_k else torch.ones(
        probs.shape[0], dtype=torch.bool, device=probs.device)
    if want.shape == got.shape:
        want, got = want.reshape(-1, width)[clear], got.reshape(-1, width)[clear]
    if want.shape != got.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 0.1):
        diff = float((got.float() - want.float()).abs().max()) if want.shape == got.shape else float("nan")
        raise TraceError(f"{_where(form.path, block)} looks like a mixture of experts (top-{form.top_k} of "
                         f"{form.router.shape[0]} experts) but hgraph's MoE op does not reproduce its output "
                         f"(max difference {diff:.3g} on an example): it routes or combines the experts otherwise "
                         "than top-k softmax routing to SwiGLU experts summed by the routing weights")


__all__ = ["MoEForm", "recognise", "swapped_moe_blocks"]
