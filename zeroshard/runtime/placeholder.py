"""The stand-in that occupies a module's parameter entry while stage 3 holds that parameter sharded
(runtime/hooks.py puts it there and takes it away).

It has the parameter's shape, dtype and device: metadata reads work, and so do the no-op casts and
moves a user's `model.to(...)` / `model.float()` make, freezing and unfreezing (passed on to the real
parameter), and `load_state_dict` copies the hooks absorb. Any computation raises a
ShardedParameterError naming the parameter instead of silently reading a freed buffer, unless the
hooks lent it a borrow (a forward reading a submodule's parameter, or an operation outside every
forward, reading or writing it, except through `.data`: hooks.py's docstring).
"""
from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import ModuleMovedError, ParameterReplacedError, ShardedParameterError

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_meta.__get__,
    torch._has_compatible_shallow_copy_type,
    # None: a gradient lives in its chunk (torch's clip_grad_norm_ on these raises: module_state.py)
    torch.Tensor.grad.__get__,
}
_REQUIRES_GRAD = {torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__}


_NEW_PARAMETER = torch.nn.Parameter.__new__.__code__  # which detaches a tensor subclass it is given
_CASTS = {torch.Tensor.to: None, torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64, torch.Tensor.cpu: None}


def _unchanged(func, args, kwargs) -> bool:
    """Whether a cast or move of the placeholder args[0] would return it as it is."""
    t = args[0]
    if func is torch.Tensor.cpu:
        return t.device.type == "cpu"
    if func is not torch.Tensor.to:
        return _CASTS[func] == t.dtype
    with torch._C.DisableTorchFunctionSubclass():
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return (device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype)


def real_parameter(t: torch.Tensor) -> torch.Tensor:
    """The parameter `t` stands for: the real one behind a placeholder the hooks put in its entry,
    else `t` itself (what a user's `model.parameters()` gives at stage 3 is a placeholder)."""
    return t._zs_param if isinstance(t, ShardedPlaceholder) and t._zs_param is not None else t


_IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and",
                                                 "or", "xor", "lshift", "rshift", "matmul")} | {"__setitem__"}


def _in_place(func) -> bool:
    """Whether `func` writes into its first argument: an in-place method (`add_`, `copy_`, nn.init's
    `normal_`) or operator (`+=`, `x[i] = v`)."""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


class ShardedPlaceholder(torch.Tensor):
    """Occupies a module's parameter entry while stage 3 holds that parameter sharded."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, shape: torch.Size, dtype, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t._zs_name = name
        t._zs_absorb_copies = False  # inside model.load_state_dict: the value went to the shard already
        t._zs_borrow = None  # Stage3Hooks.borrow: the real parameter, gathered, where it may be read
        t._zs_used = None  # Stage3Hooks.used: after the operation that read it
        t._zs_param = None  # the real parameter it stands in for
        t._zs_grad_sink = None  # catch_gradients: where a gradient accumulated into it goes
        t._zs_catching = False  # its hook for that is on
        # isinstance(t, nn.Parameter), as the entry it occupies: code that moves a parameter from
        # one entry to another (torch's parametrize, around peft's LoRA of an MoE's experts) keeps
        # it a parameter, not a buffer
        t._is_param = True
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_ and isinstance(args[0], ShardedPlaceholder) and args[0]._zs_absorb_copies:
            return args[0]
        if func in _CASTS and isinstance(args[0], ShardedPlaceholder) and _unchanged(func, args, kwargs or {}):
            return args[0]  # model.to(where it is), model.float() in fp32: nothing to do
        # nn.Module._apply putting an unchanged placeholder back (`==`: a method-wrapper is made anew each time)
        if func == torch.Tensor.data.__set__ and args[1] is args[0]:
            return None
        if func in _REQUIRES_GRAD and isinstance(args[0], ShardedPlaceholder) and args[0]._zs_param is not None:
            # freezing or unfreezing through model.parameters(): the real parameter's flag, and its stand-in's
            func(args[0]._zs_param, *args[1:], **(kwargs or {}))
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **(kwargs or {}))
            _catch(args[0])
            return args[0] if func is torch.Tensor.requires_grad_ else None
        if func == torch.Tensor.data.__set__ and isinstance(args[0], ShardedPlaceholder):  # nn.Module._apply's
            raise ModuleMovedError(
                f"zeroshard: {args[0]._zs_name} was moved or cast after zeroshard.initialize (model.to / .cuda / "
                ".half ..., or its .data replaced): the engine owns where parameters live and in which dtype. Move "
                "the model before initialize, choose the dtype with the config's precision, write values inside "
                "`with engine.full_parameters():`; the parameter is as it was")
        if func is torch.Tensor.detach and sys._getframe(1).f_code is _NEW_PARAMETER:
            raise ParameterReplacedError(
                f"zeroshard stage 3: nn.Parameter(...) made from {args[0]._zs_name} after initialize (a "
                "parametrization such as torch.nn.utils.parametrizations.weight_norm registered now, a new head "
                "from an existing weight): a new parameter zeroshard would not hold. Make such changes before "
                "zeroshard.initialize; the model is as it was")
        if func is torch.autograd.backward and _placeholders_in_inputs_only(args, kwargs or {}):
            # backward(inputs=[...]): autograd's leaf is the real parameter, save where a custom
            # Function was given the placeholder itself (Note: gradients past the placeholder)
            _refuse_placeholder_leaves(args[0], kwargs["inputs"])
            inputs = tuple(a._zs_param if isinstance(a, ShardedPlaceholder) else a for a in kwargs["inputs"])
            return func(*args, **{**kwargs, "inputs": inputs})
        flat, _ = tree_flatten((args, kwargs or {}))
        held = [a for a in flat if isinstance(a, ShardedPlaceholder)]
        borrow = held[0]._zs_borrow if held and func is not torch.Tensor.__repr__ else None
        through_data, in_place = func == torch.Tensor.data.__get__, _in_place(func)
        real = {id(a): borrow(a, through_data, in_place) for a in held} if borrow is not None else {}
        used = held[0]._zs_used if real else None  # ends what borrowing outside every forward began
        if real and all(r is not None for r in real.values()):  # read in a forward, or outside every one
            args, kwargs = tree_map_only(ShardedPlaceholder, lambda a: real[id(a)], (args, kwargs or {}))
            try:
                out = func(*args, **kwargs)
            except BaseException:
                used(None)
                raise
            got = used(out)
            return out if got is None else got
        if used is not None:
            used(None)
        names = sorted({a._zs_name for a in held})
        if func is torch.Tensor.__repr__:
            return f"ShardedPlaceholder({names[0]}, shape={tuple(args[0].shape)})"
        raise ShardedParameterError(
            f"zeroshard stage 3: parameter {', '.join(names)} was used by "
            f"{getattr(func, '__name__', func)} outside the forward of a module that owns it, while "
            "it is sharded. Use it inside that module's forward (or a module that registers it), or "
            "between steps inside `with engine.full_parameters():` (every parameter whole: an EMA copy, "
            "reading or editing weights), read engine.full_state_dict(), or use stage <= 2."
            + (" Its .data is refused here (a write through it goes unseen): write into the parameter "
               "itself under torch.no_grad() (p.clamp_(...), p.copy_(...)), and resize the model "
               "(resize_token_embeddings) or give it new data before initialize."
               if func == torch.Tensor.data.__get__ else ""))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # set_ skips __torch_function__; setting a parameter to itself is how torch's
        # register_parametrization keeps the original in place (peft's LoRA on MoE routers does so
        # at every forward): nothing changes
        if func is torch.ops.aten.set_.source_Tensor and len(args) == 2 and args[1] is args[0]:
            return args[0]
        raise ShardedParameterError(f"zeroshard stage 3: {func} reached a sharded parameter placeholder")


def _placeholders_in_inputs_only(args, kwargs) -> bool:
    rest = tree_flatten((args, {k: v for k, v in kwargs.items() if k != "inputs"}))[0]
    given = kwargs.get("inputs") or ()
    return not any(isinstance(a, ShardedPlaceholder) for a in rest) and \
        all(a._zs_param is not None for a in given if isinstance(a, ShardedPlaceholder))


def _refuse_placeholder_leaves(tensors, inputs) -> None:
    """ShardedParameterError where one of `inputs` is itself a leaf of the graph behind `tensors`
    (a custom Function took it outside its module's forward): its gradient would reach the
    placeholder, not the real parameter named in its stead (the same graph on every rank)."""
    given = {id(a): a for a in inputs if isinstance(a, ShardedPlaceholder)}
    stack = [t.grad_fn for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,))
             if isinstance(t, torch.Tensor)]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if id(leaf) in given:
            raise ShardedParameterError(
                f"zeroshard stage 3: backward(inputs=[...]) names {leaf._zs_name}, which a custom "
                "torch.autograd.Function was given outside the forward of its module: its gradient reaches the "
                "sharded placeholder, which backward(inputs=...) cannot follow. Call backward without inputs "
                "(freeze what should not train), or use stage <= 2")
        stack.extend(f for f, _ in node.next_functions)


# Note: gradients past the placeholder. An operation on a placeholder in a forward or outside every
# one runs on the real parameter (__torch_function__ swaps it in), so autograd records the real one
# and its gradient reaches the chunk. A custom torch.autograd.Function's apply takes its tensors as
# they are, below __torch_function__: its forward gets the placeholder (the operations inside still
# run on the real values), and autograd records the placeholder as the input, so the gradient was
# accumulated into the placeholder's .grad, where nothing read it: the parameter silently trained on
# nothing (a fused linear-cross-entropy kernel given lm_head.weight in the model's forward, a
# Function in the user's loss). Each placeholder of a trainable parameter has a hook that hands
# such a gradient to the engine as the real parameter's.
def catch_gradients(placeholders, arrived) -> None:
    """Hand a gradient autograd accumulates into any of `placeholders` to `arrived(param, grad)`
    (the real parameter's storage may be released, so it cannot hold it as .grad), now and when a
    frozen one's parameter is unfrozen."""
    for t in placeholders:
        t._zs_grad_sink = arrived
        _catch(t)


def _catch(t: ShardedPlaceholder) -> None:
    if t._zs_grad_sink is None or t._zs_catching or not t.requires_grad:
        return
    with torch._C.DisableTorchFunctionSubclass():
        t.register_post_accumulate_grad_hook(_to_parameter)
    t._zs_catching = True


def _to_parameter(t: ShardedPlaceholder) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        grad, t.grad = t.grad, None
    t._zs_grad_sink(t._zs_param, grad)
