"""`zeroshard plan MODEL --nodes 1,8,64,1024`: full sharding, HSDP and hpZ at each node count, on
two link classes (planning/links.py has the model), and which one the planner picks."""
from __future__ import annotations

import json

from .args import UsageError, parameter_count
from .model import load_model
from .plan import _params_words, _transformer_shape, markdown


def cmd_plan_nodes(args) -> int:
    from ..planning.links import Job, Links, compare
    psi = parameter_count(args.model)
    layers, hidden, source = args.layers, args.hidden, None
    if psi is None:
        loaded = load_model(args.model, checkpointing=False)
        psi = float(sum(p.numel() for p in loaded.model.parameters()))
        shape = _transformer_shape(getattr(loaded.model, "config", None)) or (None, None)
        layers, hidden, source = layers or shape[0], hidden or shape[1], loaded.source
    source = f"{source + ': ' if source else ''}{_params_words(psi)} parameters"
    if (layers is None) != (hidden is None):
        raise UsageError("--layers and --hidden go together (the transformer's shape, for its activations)")
    links = Links(gpus_per_node=args.gpus_per_node, intra=args.intra_node_bandwidth or 300e9,
                  inter=args.inter_node_bandwidth or 25e9)
    job = Job(params=psi, gpu_memory=args.gpu_memory or 80e9, flops=(args.tflops or 400) * 1e12,
              adam=args.gpu_adam or 50e9, global_tokens=args.global_batch_tokens, seq_len=args.seq_len or 4096,
              micro_batch=args.micro_batch or 1, checkpointing=args.checkpointing, layers=layers, hidden=hidden,
              elem_bytes=4 if args.precision == "fp32" else 2)
    results = compare(args.nodes, job, links)
    if args.json:
        print(json.dumps({"model": args.model, "params": psi, "links": vars(links), "job": vars(job), "scales": [
            {"nodes": preds[0].nodes, "gpus": preds[0].world, "accumulation": preds[0].accumulation,
             "pick": pick.layout if pick else None,
             "layouts": [{"layout": p.layout, "regather": p.regather, "device_bytes": p.device_bytes, "fits": p.fits,
                          "step_s": p.step_s, "compute_s": p.compute_s, "overlapped_s": p.overlapped_s,
                          "blocking_s": p.blocking_s, "optimizer_s": p.optimizer_s, "volumes": p.volumes,
                          "across_elements": p.across_elements}
                         for p in preds]} for preds, pick in results]}, indent=1))
        return 0 if all(pick for _, pick in results) else 2
    acts = "activations: " + (f"{layers} layers x hidden {hidden}, " + ("checkpointed at each layer" if
                              args.checkpointing else "not checkpointed") if layers else
                              "not counted (give --layers and --hidden, or a model)")
    print(f"model: {source}; {args.precision}, Adam (16 bytes per parameter of model states); {acts}")
    print(f"job: {job.global_tokens:,} tokens per step in sequences of {job.seq_len} tokens, "
          f"{job.micro_batch} per micro-batch per GPU")
    print(f"cluster: {links.gpus_per_node} GPUs per node of {job.gpu_memory / 1e9:g} GB, "
          f"{job.flops / 1e12:g} TFLOP/s achieved; links per GPU: inside a node {links.intra / 1e9:g} GB/s "
          f"({links.intra_latency * 1e6:g} us per hop), across nodes {links.inter / 1e9:g} GB/s "
          f"({links.inter_latency * 1e6:g} us per hop); link model: zeroshard/planning/links.py")
    head = ("nodes", "GPUs", "layout", "rCache", "GB per GPU", "fits", "micro-batches", "across GB per step",
            "step s", "tokens/s per GPU", "pick")
    rows = []
    for preds, pick in results:
        for p in preds:
            tokens = p.accumulation * job.micro_batch * job.seq_len
            rows.append((str(p.nodes), str(p.world), p.layout, "2 chunks" if p.regather else "all",
                         f"{p.device_bytes / 1e9:.1f}", "yes" if p.fits else "no",
                         str(p.accumulation), f"{p.across_elements * job.elem_bytes / 1e9:.1f}", f"{p.step_s:.2f}",
                         f"{tokens / p.step_s:,.0f}", "<-" if p is pick else ""))
    print(markdown(head, rows))
    for preds, pick in results:
        if pick is None:
            nodes = preds[0].nodes
            print(f"at {nodes} node{'s' if nodes > 1 else ''} nothing fits {job.gpu_memory / 1e9:g} GB per GPU: "
                  "more nodes, --checkpointing, a smaller micro-batch, or offload (`zeroshard plan MODEL` without "
                  "--nodes)")
    return 0 if all(pick for _, pick in results) else 2
