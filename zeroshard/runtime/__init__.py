"""Floor 4, what runs in each step: parameters packed into chunks (chunks.py, layout.py), the rCache
of gathered chunks (cache.py), the stage-3 hooks that gather and release them (hooks.py;
placeholder.py stands in for a sharded parameter) and the stage 1-2 arrival guard (arrival.py),
gradients reduced into their shards (reducer.py), saved tensors kept as references or offloaded
(saved_tensors.py) and partitioned over TP (partitioned_activations.py), transfers between device
and host (offload.py), precision casts (precision.py), the model's own methods kept truthful
(module_state.py, and torch's gradient readers: grad_readers.py) and models built on the meta
device (materialize.py)."""
