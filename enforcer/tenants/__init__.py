"""Who and how much: containers from cgroups and engines, their limits, the configuration file."""
