"""Floor 6, before the first step: the model profiled on the meta device (profiler.py, counting with
meta_counters.py), the machine measured (hardware.py), the chunk schedules a plan is made of
(schedule.py), the fastest plan that fits (planner.py, applied by auto_plan.py) and the ZeRO paper's
closed-form figures (estimate.py). It sits above runtime and optim because it sizes chunks
with runtime's packer and times the optimizer it will run."""
