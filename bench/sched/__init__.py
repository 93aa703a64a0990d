"""The scheduling experiment (issue 5, experiment 4; ConVGPU Tables IV-V): a seeded workload,
a discrete-event simulator over the enforcer's own policy code, real runs under `convgpu
enforce`, and the resume-latency / enforcer-CPU benchmark (issue 3). See docs/SCHEDULING.md."""
