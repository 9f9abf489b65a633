"""Running a model: `engine` (FlexGen's block schedule over tiers), `generation` (sampling,
generate, teacher-forced NLL on the engine), `placement`, `offload` (tiers and copy lanes),
`memory` (per-tier plan checked before a run), `costmodel` and `search` (automatic placement),
`calibration` (this machine's measured rates), `machine` (what a result records about where it
ran: device, versions, commit), `rundir` and `progress`."""
