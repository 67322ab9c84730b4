"""The process the engine runs in: `devices` (device, dtype, the KV budget), `openmp` (the thread
pools), `host_memory` (the allocator), `warmup`, `faults` (injected failures, for tests), `knobs`
(the KVTOP_* environment variables) and `log`."""
