"""What-if: replay a recorded workload through the engine's own `Scheduler` and `BlockManager`
under another configuration, on a simulated clock, with no model (docs/whatif.md).

`config.py` (the configuration simulated, sized like the engine sizes its cache), `timing.py`
(how long a step takes: fitted to the recording's steps, or the recorded times themselves),
`sim.py` (the step loop), `figures.py` (the figures of a run, recorded or simulated).
"""
