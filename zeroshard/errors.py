"""Every public error of zeroshard, in one place. Each is a `ZeroShardError`, so `except
zeroshard.ZeroShardError` catches whatever zeroshard raises on purpose, and keeps the built-in base
it had (ValueError, RuntimeError, FloatingPointError), so older `except` clauses still match.
This module imports nothing: every floor of the package may raise these.
"""
from __future__ import annotations


class ZeroShardError(Exception):
    """Base of every error zeroshard raises on purpose (a bad input, a damaged file, a lost rank)."""


class ConfigError(ZeroShardError, ValueError):
    """A config or an argument that cannot be used: an unknown key, a bad value, a file that does not
    parse or does not exist, an optimizer or a tensor-parallel split that does not fit the model.
    The message names the key, the argument or the file."""


class EngineCallError(ZeroShardError, RuntimeError):
    """A call the engine cannot take as it was made: in the wrong phase (a backward inside a forward
    or another backward, a state call during a step, load_weights inside full_parameters(),
    compile_with after compiling, a collective after the process groups were taken down) or the
    wrong way (loss.backward() where fp16's loss scaling needs engine.backward(loss), a step with
    a closure, load_state_dict(assign=True), the integrations' optimizer state_dict). The message
    says which call to make instead."""


class PlanError(ZeroShardError, RuntimeError):
    """offload/stage "auto" found no plan: the profile of the model on the meta device failed (its
    error is named), or no configuration fits the memory (the message says what each needs)."""


class DivergedError(ZeroShardError, RuntimeError):
    """Ranks were about to issue different collectives: their call order diverged."""


class PeerLostError(ZeroShardError, RuntimeError):
    """Another rank is gone while this one waited for it: it died, was killed or exited (its
    connections closed: raised at once), or it stopped or hung (CollectiveTimeoutError, after
    config collective_timeout_s). The message names what was being waited for and the optimizer
    step; the backend's own error is the cause."""


class CollectiveTimeoutError(PeerLostError):
    """A collective waited longer than config collective_timeout_s for the other ranks: one of them
    is stopped, hung, or far behind (a rank that died shows at once, as a PeerLostError)."""


class ShardedParameterError(ZeroShardError, RuntimeError):
    """A stage-3 parameter was computed with outside the forward of a module that owns it."""


class UninitializedTensorError(ZeroShardError, RuntimeError):
    """A tensor of a meta-device model that no initialiser writes (see materialize.py)."""


class GradientsInChunksError(ZeroShardError, RuntimeError):
    """A torch function that reads parameters' .grad was given parameters zeroshard trains: their
    gradients live in its chunks, so it would see none."""


class ModuleMovedError(ZeroShardError, RuntimeError):
    """model.to() / .cuda() / .half(), or `param.data = ...` (resize_token_embeddings), after
    initialize moved parameters out of zeroshard's chunks."""


class ParameterReplacedError(ZeroShardError, RuntimeError):
    """A new parameter, or a module holding parameters zeroshard does not hold, was assigned into a
    wrapped model after initialize (resize_token_embeddings, a new head, peft's get_peft_model):
    zeroshard's chunks hold the parameters it would replace. Such changes go before initialize."""


class UnsupportedModelError(ZeroShardError, TypeError):
    """A model zeroshard cannot train as it is, found at initialize before anything changed: a
    parameter whose values the fp32/16-bit chunks cannot hold (float64, complex, integer), a
    module that makes sparse gradients, or one that writes into its weight inside its forward
    where that write would be kept on one rank only or lost (an embedding with max_norm, above a
    world size of 1 or at stage 3). The message names each one and what to change."""


class ModuleCopyError(ZeroShardError, TypeError):
    """A module that zeroshard.initialize wrapped was pickled or copied (its parameters are views of
    the engine's chunks and its hooks call the engine: a copy would not be a model of its own)."""


class FrozenParameterError(ZeroShardError, RuntimeError):
    """A parameter frozen at `zeroshard.initialize` and unfrozen since has no param group to join:
    the optimizer callable split the tensors it was handed into several groups by position."""


class NonFiniteError(ZeroShardError, FloatingPointError):
    """A gradient was NaN or inf with config nonfinite='raise' (raised on every rank)."""


class WeightsError(ZeroShardError, RuntimeError):
    """Pretrained weights could not be loaded or saved: unreadable files, or keys missing,
    unexpected or of the wrong shape (all listed). Raised on every rank."""


class CheckpointError(ZeroShardError, RuntimeError):
    """A checkpoint that cannot be saved or loaded: missing, damaged, or of another model; also an
    optimizer state dict that `optimizer.load_state_dict` cannot give this rank's pieces (another
    rank's shard, another optimizer's groups)."""


class TierFileError(ZeroShardError, OSError):
    """The disk tier's file cannot be used: its directory is not writable or is another job's, the
    disk is full, or a record read back is not the one written (the file was changed, truncated
    or removed under the job). The message names the file and the record."""


class InternalError(ZeroShardError, RuntimeError):
    """zeroshard broke one of its own invariants (a chunk or the engine in a state its next step
    does not allow): a bug in zeroshard, to be reported. Checked explicitly, so `python -O` keeps
    the checks that protect the training state."""


def invariant(holds: bool, what) -> None:
    """Raise InternalError unless `holds`; `what()` (a callable, so a passing check costs nothing)
    says what was expected."""
    if not holds:
        raise InternalError(f"zeroshard internal error: {what()} (please report it)")


class PeerLostInCheckpointError(CheckpointError, PeerLostError):
    """Another rank was lost while a checkpoint was being saved or loaded: a CheckpointError (what
    the save or load raises) and a PeerLostError (what every wait raises for a lost peer)."""
