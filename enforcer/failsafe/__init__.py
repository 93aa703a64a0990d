"""Never leaving work stopped: the stall backends, the watchdog, the heartbeat and taking over from a predecessor."""
