"""Running a model: `engine` (FlexGen's block schedule over tiers; `Engine.run` returns a
`RunResult`), `graphs` (CUDA graphs of steady decode steps), `generation` (sampling, generate,
teacher-forced NLL on the engine), `placement`, `offload` (tiers and copy lanes), `memory`
(per-tier plan checked before a run), `machine` (what a result records about where it ran:
device, versions, commit), `rundir` and `progress`.

May import `flexevict.core`, `flexevict.io`, `flexevict.policies` and `flexevict.errors`;
never the planner (it plans runs; a run does not plan itself) nor the command-line modules.
"""
