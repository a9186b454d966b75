"""The diffusers model class a checkpoint's config.json names, imported only when a check needs it; or the user's
own class, named on the command line (`--model-class module:Class`).

Torch-free to import (torch and diffusers come with the class): the conversion path asks for a class only for plan
files, and for CP meshes whose plan has no CP plan of its own (`check_cp_plan`).

Data never names code to import: a config.json's `_class_name` is looked up as an attribute of `diffusers` only.
A class outside diffusers and transformers is imported only from a `module:Class` the user gives
(`import_class_spec`), and is then used for the checkpoint's `_class_name` within `user_model_class(cls)`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import keyword
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from preshard.errors import MismatchError, PlanError, UsageError
from preshard.progress import note

if TYPE_CHECKING:
    from preshard.format.plan import Plan


def is_transformers_config(config: dict[str, Any] | None) -> bool:
    """config.json of a transformers model: `architectures` (a list of class names) and `model_type`, and no
    diffusers `_class_name`."""
    config = config or {}
    architectures = config.get("architectures")
    return (
        "_class_name" not in config
        and isinstance(config.get("model_type"), str)
        and isinstance(architectures, list)
        and bool(architectures)
        and all(isinstance(a, str) for a in architectures)
    )


_SPEC_HELP = "give module:Class, e.g. --model-class my_models.dit:MyTransformer2DModel"

# The user's own model class for the conversion in progress (`user_model_class`); None: diffusers' classes only.
_USER_CLASS: ContextVar[type | None] = ContextVar("preshard_user_model_class", default=None)


def parse_class_spec(spec: object) -> tuple[str, str]:
    """`"pkg.module:Class"` -> `("pkg.module", "Class")`, checked for syntax only (nothing imported).

    Raises:
        UsageError: not a string of the form `module:Class` (identifiers, the module dotted).
    """
    if not isinstance(spec, str):
        raise UsageError(f"a model class is named module:Class, not {type(spec).__name__}; {_SPEC_HELP}")
    module_name, colon, attr = spec.strip().partition(":")
    names = [*module_name.split("."), attr]
    if not colon or not all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        raise UsageError(
            f"--model-class {spec!r} is not module:Class (Python identifiers, the module dotted); {_SPEC_HELP}"
        )
    return module_name, attr


def import_class_spec(spec: str, progress: bool | None = None) -> type:
    """The class `spec` (`module:Class`) names, imported as Python imports it (`sys.path`: the installed packages,
    PYTHONPATH, and for `python -m preshard` the current folder). Only ever called with what the user typed or
    passed: this imports and runs the user's code. `progress`: say so on stderr first (None: on a terminal).

    Example:
        >>> import_class_spec("collections:OrderedDict").__name__  # a class (not a model: see `check_model_class`)
        'OrderedDict'

    Raises:
        UsageError: bad syntax, no such module (or it fails to import: its error in one line), no such attribute,
            or an attribute that is not a class.
    """
    module_name, attr = parse_class_spec(spec)
    note(f"importing model class {module_name}:{attr} (--model-class)", progress)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name) and module_name[len(exc.name) :][:1] in ("", "."):
            raise UsageError(
                f"--model-class {spec}: no module named {exc.name!r} on the Python path; install it, or add its "
                "folder to PYTHONPATH"
            ) from None
        raise UsageError(f"--model-class {spec}: importing {module_name} failed: {exc}") from None
    except Exception as exc:  # the user's module fails in its own way: one line, naming it
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(
            f"--model-class {spec}: importing {module_name} failed: {type(exc).__name__}: {detail}"
        ) from None
    found = getattr(module, attr, None)
    if found is None:
        raise UsageError(f"--model-class {spec}: module {module_name} has no attribute {attr!r}")
    if not inspect.isclass(found):
        raise UsageError(f"--model-class {spec}: {module_name}.{attr} is a {type(found).__name__}, not a class")
    return found


def class_spec_of(cls: type) -> str:
    """How the manifest records a user's class: `module:Class` (a record, never imported from)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def check_model_class(cls: type, config: dict[str, Any] | None) -> None:
    """`cls` (the user's class) is a torch module class and the checkpoint's: config.json's `_class_name` names it
    (as `load_sharded` will check).

    Raises:
        UsageError: not an `nn.Module` class. MismatchError: config.json names another class, or none.
    """
    from torch import nn

    if not inspect.isclass(cls) or not issubclass(cls, nn.Module):
        name = getattr(cls, "__name__", type(cls).__name__)
        raise UsageError(f"model class {name} is not a torch.nn.Module class; name the model's class (a ModelMixin)")
    declared = (config or {}).get("_class_name")
    if not isinstance(declared, str):
        raise MismatchError(
            f"the checkpoint's config.json names no model class (_class_name) for {cls.__name__}; save the model "
            'with save_pretrained (which writes it), or add "_class_name": "' + cls.__name__ + '" to config.json'
        )
    if declared != cls.__name__:
        raise MismatchError(
            f"the checkpoint's config.json names {declared}, not {cls.__name__} (--model-class); name the class "
            "the checkpoint was saved from"
        )


@contextlib.contextmanager
def user_model_class(cls: type | None) -> Iterator[None]:
    """Within the block, `import_model_class(cls.__name__)` is `cls` (the user's class, named explicitly) rather
    than a diffusers attribute; scoped to this context (a thread started inside takes it only through
    `contextvars.copy_context()`; a forked worker inherits it). `None`: no change.

    Example:
        >>> with user_model_class(MyTransformer2DModel):  # doctest: +SKIP
        ...     plan = choose_plan(None, config, tp=2)
    """
    if cls is None:
        yield
        return
    token = _USER_CLASS.set(cls)
    try:
        yield
    finally:
        _USER_CLASS.reset(token)


def import_model_class(class_name: str) -> type:
    """`diffusers.<class_name>`; the user's class where one is in scope under that name (`user_model_class`).

    Raises:
        PlanError: diffusers is not installed, or has no such class.
    """
    user = _USER_CLASS.get()
    if user is not None and user.__name__ == class_name:
        return user
    if "diffusers" not in sys.modules:
        note(f"importing diffusers for the model class {class_name}")  # seconds of CPU, silent otherwise
    from torch import nn

    try:
        import diffusers
    except ImportError:
        raise PlanError(
            f"the checkpoint's model class {class_name} has no built-in plan; reading the plan it declares needs "
            "diffusers: pip install 'preshard[diffusers]', or pass --plan NAME|FILE"
        ) from None
    cls = getattr(diffusers, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise PlanError(
            f"no built-in plan for model class {class_name}, and diffusers {diffusers.__version__} has no such "
            "model class; pass --plan NAME|FILE, or --model-class module:Class for a class of your own"
        )
    return cls


def declared_class(config: dict[str, Any] | None) -> type | None:
    """The diffusers class config.json's `_class_name` names, or None where there is none to import."""
    class_name = (config or {}).get("_class_name")
    if not isinstance(class_name, str):
        return None
    try:
        return import_model_class(class_name)
    except PlanError:
        return None


def check_cp_plan(plan: Plan, config: dict[str, Any] | None, cp: int) -> None:
    """A CP mesh (`cp` = ring x ulysses > 1) needs a CP plan: the plan's own, or the model class's `_cp_plan`
    (what the runtime uses): refused when converting rather than by every rank at load. Imports diffusers (~2 s)
    unless the plan has its own; an unknown class is not checked.

    Raises:
        PlanError: neither the plan nor the model class has one; a config value the CP plan does not work for.
    """
    if cp <= 1:
        return
    plan.check_cp_config(config)
    if plan.cp_plan:
        return
    cls = declared_class(config)  # torch and diffusers: only for a plan without a CP plan of its own
    if cls is not None and not getattr(cls, "_cp_plan", None):
        raise PlanError(
            f"plan {plan.name} has no cp_plan and {cls.__name__} declares no _cp_plan, so no rank could load a "
            f"context-parallel mesh (ring x ulysses = {cp}): use ring=1 and ulysses=1 (--cp 1), or add a cp_plan "
            "to a plan file"
        )
