"""Which code plan inference knows, so that it shards nothing whose computation it has not seen (`plans/infer.py`).

Inference splits a unit (an attention module, a feed-forward, a single-stream block) only where the code that runs
it is code preshard knows how it uses the heads and the hidden width:
- an attention module of a class diffusers defines, whose processor is a class diffusers defines that takes no
  width or head count of its own (every diffusers processor reads the head count from the module, whose attributes
  the runtime divides) and holds no weights (IP-adapter and custom-diffusion processors carry projections of their
  own);
- a feed-forward of a class the plans handle (`FEED_FORWARDS`, by identity): diffusers' `FeedForward` with one of
  diffusers' activations, the diffusers MLP classes the tiny zoo proves, or an `nn.Sequential` of Linears and
  element-wise activations;
- a block whose own forward combines the split layers (`BLOCK_MLPS`, `SINGLE_STREAM_BLOCKS`), by identity.

A class "diffusers defines" is found by identity, not by name: its module is under `diffusers.`, and that module's
attribute of its name is the class itself (a class of the user's that sets `__module__` to a diffusers module is
not it). A subclass is a different class: whatever it overrides is custom code.

Custom code around units (a block or model class of the user's, built from diffusers' blocks) runs replicated, on
whole inputs: it is exact as long as it only calls the units. `reached_units` reads its source and names each
unit it reaches into instead (`self.attn.to_q(x)`, `block.attn.heads`, `self.ff.net[0]`, the unit handed to
another function, or a walk over `self.modules()`): inference keeps those units whole, which is exact, since their
inputs are whole too.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Iterable

from torch import nn

# Qualified names of the feed-forward classes whose forward inference knows (the tiny zoo proves each at tp=2).
FEED_FORWARDS = frozenset(
    {
        "diffusers.models.attention.FeedForward",
        "diffusers.models.attention.LuminaFeedForward",
        "diffusers.models.transformers.ace_step_transformer.AceStepMLP",
        "diffusers.models.transformers.auraflow_transformer_2d.AuraFlowFeedForward",
        "diffusers.models.transformers.transformer_cosmos3.Cosmos3VLTextMLP",
        "diffusers.models.transformers.transformer_ernie_image.ErnieImageFeedForward",
        "diffusers.models.transformers.transformer_bria_fibo2.FeedForward",
        "diffusers.models.transformers.transformer_flux2.Flux2FeedForward",
        "diffusers.models.transformers.transformer_flux3.Flux3FeedForward",
        "diffusers.models.transformers.transformer_hidream_image.HiDreamImageFeedForwardSwiGLU",
        "diffusers.models.transformers.transformer_ideogram4.Ideogram4MLP",
        "diffusers.models.transformers.transformer_krea2.Krea2SwiGLU",
        "diffusers.models.transformers.transformer_omnigen.OmniGenFeedForward",
        "diffusers.models.transformers.transformer_prx.MLPEmbedder",
        "diffusers.models.transformers.transformer_qwenimage21.QwenImage21SwiGLUFeedForward",
        "diffusers.models.transformers.transformer_stable_audio3.StableAudio3FeedForward",
        "diffusers.models.transformers.transformer_z_image.FeedForward",
    }
)
# diffusers' activation modules that a FeedForward's `net.0` may be: element-wise after their projection.
ACTIVATIONS = frozenset(
    f"diffusers.models.activations.{name}"
    for name in ("GELU", "GEGLU", "SwiGLU", "ApproximateGELU", "LinearActivation")
)
# torch modules that act element-wise (or not at all): what an `nn.Sequential` MLP may hold beside its Linears.
ELEMENTWISE = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Dropout, nn.Identity, nn.LeakyReLU)
# Blocks whose forward runs their own split MLP (`ff_in`/`ff_out`) or cat([attention, mlp]) into `proj_out`.
BLOCK_MLPS = frozenset(
    {
        "diffusers.models.transformers.transformer_ideogram4.Ideogram4EmbedScalar",
        "diffusers.models.transformers.transformer_minimax_music3.MiniMaxMusic3TransformerBlock",
    }
)
SINGLE_STREAM_BLOCKS = frozenset(
    f"diffusers.models.transformers.{name}"
    for name in (
        "transformer_bria.BriaSingleTransformerBlock",
        "transformer_bria_fibo.BriaFiboSingleTransformerBlock",
        "transformer_chroma.ChromaSingleTransformerBlock",
        "transformer_flux.FluxSingleTransformerBlock",
        "transformer_hunyuan_video.HunyuanVideoSingleTransformerBlock",
        "transformer_hunyuan_video.HunyuanVideoTokenReplaceSingleTransformerBlock",
        "transformer_hunyuanimage.HunyuanImageSingleTransformerBlock",
        "transformer_longcat_image.LongCatImageSingleTransformerBlock",
        "transformer_motif_video.MotifVideoSingleTransformerBlock",
        "transformer_ovis_image.OvisImageSingleTransformerBlock",
    )
)
_LIBRARIES = ("diffusers.", "transformers.", "torch.", "huggingface_hub.", "peft.", "accelerate.")
# Processor constructor arguments that would give it a width or head count of its own.
_OWN_WIDTH = ("head", "hidden_size", "dim", "width")
# Module methods and attributes that reach every submodule: a walk the source does not name.
_WALKS = frozenset(
    {"modules", "named_modules", "children", "named_children", "_modules", "get_submodule", "apply", "state_dict",
     "get_parameter", "__dict__"}
)  # fmt: skip


def qualified(cls: type) -> str:
    """`module.QualName` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def library_class(cls: type, libraries: tuple[str, ...] = _LIBRARIES) -> bool:
    """Whether `cls` is defined by one of `libraries` (diffusers, transformers, torch), by identity: its module is
    under one of them and holds it under its name."""
    module = sys.modules.get(cls.__module__, None)
    if module is None or not cls.__module__.startswith(libraries):
        return False
    found: object = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def known_by_name(cls: type, names: Iterable[str]) -> bool:
    """Whether `cls` is one of the classes `names` lists (qualified names), by identity."""
    return qualified(cls) in names and library_class(cls, ("diffusers.",))


def hooked(module: nn.Module) -> str | None:
    """The first module in `module` (itself included) with a forward hook or pre-hook: code that runs around it."""
    for name, m in module.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return name or "itself"
    return None


def unknown_attention(module: nn.Module) -> str | None:
    """Why inference does not know how attention `module` uses its heads, or None where it does."""
    cls = type(module)
    if (where := hooked(module)) is not None:
        return f"a forward hook of the user's runs on {where}"
    if not library_class(cls, ("diffusers.",)):
        return f"its class {cls.__name__} is not one of diffusers' attention classes"
    processor = getattr(module, "processor", None)
    kind = type(processor)
    if processor is None or not library_class(kind, ("diffusers.",)):
        return f"its processor {kind.__name__} is custom code (not one of diffusers' processor classes)"
    if isinstance(processor, nn.Module) and any(True for _ in processor.parameters()):
        return f"its processor {kind.__name__} holds weights of its own"
    if any(part in p.lower() for p in _init_parameters(kind) for part in _OWN_WIDTH):
        return f"its processor {kind.__name__} is built with a width or head count of its own"
    return None


def _init_parameters(cls: type) -> tuple[str, ...]:
    init = next((c.__dict__["__init__"] for c in cls.__mro__ if "__init__" in c.__dict__), None)
    try:
        return tuple(inspect.signature(init).parameters) if init is not None else ()
    except (TypeError, ValueError):
        return ()


def known_feed_forward(module: nn.Module) -> bool:
    """Whether `module`'s forward is one inference knows (see the module docstring)."""
    cls = type(module)
    if hooked(module) is not None:
        return False
    if cls is nn.Sequential:
        return all(isinstance(m, (nn.Linear, *ELEMENTWISE)) and type(m).forward is not nn.Module.forward
                   for m in module.children())  # fmt: skip
    if not known_by_name(cls, FEED_FORWARDS):
        return False
    net = getattr(module, "net", None)
    if isinstance(net, nn.ModuleList) and len(net) and qualified(cls) == "diffusers.models.attention.FeedForward":
        first = net[0]
        return known_by_name(type(first), ACTIVATIONS) and all(
            type(m) in (nn.Linear, nn.Dropout, nn.Identity) for m in list(net)[1:]
        )
    return True


def custom_classes(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of `model` whose class is not defined by diffusers, transformers or torch (name -> module)."""
    return {name: m for name, m in model.named_modules() if not library_class(type(m))}


def reached_units(model: nn.Module, units: Iterable[str]) -> dict[str, str]:
    """The units (module names) that custom code in `model` reaches into rather than only calls, each with where:
    `{unit: "CLASS.method reads self.attn.to_q"}`. Source that cannot be read reaches every unit below it.

    Args:
        model: the model (on the meta device is fine).
        units: names of the modules inference would split.

    Returns:
        unit name -> a short description of the reaching code.

    Example:
        >>> reached_units(model, ["blocks.0.attn"])  # a block whose forward calls self.attn.to_q(x)
        {'blocks.0.attn': 'Block.forward uses self.attn.to_q'}
    """
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = set(units)
    found: dict[str, str] = {}
    for name, module in custom_classes(model).items():
        where = name or "(the model)"
        for method, chains in _class_chains(type(module)):
            if chains is None:  # no source to read: everything below may be reached
                for unit in unit_names:
                    if _below(unit, name):
                        found.setdefault(unit, f"{method} ({where}): its source cannot be read")
                continue
            for chain, use in chains:
                for target, deeper in _resolve(module, chain):
                    path = names.get(id(target))
                    if path is None:
                        continue
                    for unit in unit_names:
                        inside = _below(path, unit) and (path != unit or deeper)
                        walks = use in ("walk", "passed") and _below(unit, path)  # handed on: may reach in
                        if inside or walks:
                            what = ".".join(chain) or "self"
                            what += "'s modules" if use == "walk" else ""
                            verb = {"walk": "walks", "passed": "passes"}.get(use, "uses")
                            found.setdefault(unit, f"{method} ({where}) {verb} {what}")
    return found


def _below(name: str, ancestor: str) -> bool:
    return not ancestor or name == ancestor or name.startswith(f"{ancestor}.")


_Chain = tuple[str, ...]


_Methods = tuple[tuple[str, tuple[tuple[_Chain, str], ...] | None], ...]
_CHAINS: dict[type, _Methods] = {}


def _class_chains(cls: type) -> _Methods:
    """`_read_chains(cls)`, once per class."""
    if cls not in _CHAINS:
        _CHAINS[cls] = _read_chains(cls)
    return _CHAINS[cls]


def _read_chains(cls: type) -> _Methods:
    """For each method of `cls` and of its custom bases (not `__init__`, which runs at construction, where inference
    sees what it builds): the attribute chains its code uses, each with how ("call": called directly, "use": read
    further or as a value, "passed": handed to a call, "walk": a walk over modules); None for a method whose source
    cannot be read."""
    found: list[tuple[str, tuple[tuple[_Chain, str], ...] | None]] = []
    for klass in cls.__mro__:
        if klass is object or library_class(klass):
            continue
        for attr, value in vars(klass).items():
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if attr == "__init__" or not inspect.isfunction(function):
                continue
            where = f"{klass.__name__}.{attr}"
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                found.append((where, None))
                continue
            node = tree.body[0] if tree.body else None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((where, _chains(node)))
            else:  # a lambda or other expression: read whole
                found.append((where, None))
    return tuple(found)


def _chains(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[tuple[_Chain, str], ...]:
    """The chains rooted at `self` (or a local name bound from one) that `function` uses, with how."""
    args = function.args.posonlyargs + function.args.args
    if not args:
        return ()
    aliases: dict[str, set[_Chain]] = {args[0].arg: {()}}
    for node in ast.walk(function):  # local names bound to a chain, or to the items of one (flow-insensitive)
        targets, value, items = [], None, False
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.For, ast.comprehension)):
            targets, value, items = [node.target], node.iter, True
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "enumerate":
                value = value.args[0] if value.args else None
                targets = [t.elts[1] for t in targets if isinstance(t, ast.Tuple) and len(t.elts) == 2]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets, value = [node.optional_vars], node.context_expr
        for target in targets:
            if isinstance(target, ast.Name) and value is not None:
                for chain in _chain_of(value, aliases):
                    aliases.setdefault(target.id, set()).add((*chain, "[*]") if items else chain)
    uses: set[tuple[_Chain, str]] = set()
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    called = {id(n.func) for n in calls}
    called |= {id(a) for n in calls if _checkpointing(n.func) for a in n.args[:1]}  # it calls what it is given
    passed = {id(a) for n in calls for a in (*n.args, *(k.value for k in n.keywords))}
    parents = {id(c): p for p in ast.walk(function) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(function):
        if not isinstance(node, (ast.Attribute, ast.Subscript, ast.Name)):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, (ast.Attribute, ast.Subscript)) and getattr(parent, "value", None) is node:
            continue  # only the longest chain
        if isinstance(parent, ast.Assign) or isinstance(parent, (ast.For, ast.comprehension)):
            continue  # an alias binding, resolved through the alias
        for chain in _chain_of(node, aliases):
            if chain and chain[-1] in _WALKS:
                uses.add((chain[:-1], "walk"))
            elif id(node) in called:
                uses.add((chain, "call"))
            elif chain and chain[-1] == "forward":
                uses.add((chain[:-1], "call"))
            elif id(node) in passed:
                uses.add((chain, "passed"))
            else:
                uses.add((chain, "use"))
        if isinstance(node, ast.Name) and node.id in ("getattr", "vars") and id(node) in called:
            uses.add(((), "walk"))
    return tuple(sorted(uses))


def _checkpointing(func: ast.AST) -> bool:
    """diffusers' gradient checkpointing call (`self._gradient_checkpointing_func(block, ...)`), which calls its
    first argument with the others."""
    return isinstance(func, ast.Attribute) and func.attr == "_gradient_checkpointing_func"


def _chain_of(node: ast.AST, aliases: dict[str, set[_Chain]]) -> set[_Chain]:
    """The chains (from `self`) an expression names: `self.a[0].b` -> {("a", "[*]", "b")}; empty if none."""
    steps: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            steps.append("[*]")
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _WALKS:
            steps.append(node.func.attr)
            node = node.func.value
        else:
            break
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return set()
    return {(*base, *reversed(steps)) for base in aliases[node.id]}


def _resolve(module: nn.Module, chain: _Chain) -> list[tuple[nn.Module, bool]]:
    """The modules `chain` reaches from `module`, each with whether the chain goes on past it (to an attribute
    that is not a submodule: `heads`, `weight`, a method)."""
    current: list[nn.Module] = [module]
    for i, step in enumerate(chain):
        nxt: list[nn.Module] = []
        for m in current:
            if step == "[*]":
                nxt += list(m.children()) if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) else []
            elif (child := m._modules.get(step)) is not None:
                nxt.append(child)
        if not nxt:
            return [(m, True) for m in current] if i else []
        current = nxt
    return [(m, False) for m in current]
