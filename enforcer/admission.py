"""What BPF is told about admission (its `control` map, written through BpfMaps): whether it
admits at all, whom it skips (a self-test child, the context measurement's child), how many
wait (frees and exits wake the loop only then), whether alloc/free events flow (a view asked
lately), what a newcomer's context reserves, --over-limit kill, which enforcer owns admission,
and the map quotas. The heartbeat (failsafe/heartbeat.py) rewrites the same fields."""
import contextlib
import time

VIEW_GRACE = 10.0        # s after a view's last snapshot: alloc/free events flow (else quiet)


class Admission:
    """Handed BpfMaps (the writer) and the readers of the fields it does not own:
    waiters(): how many (container, device) waits there are (Books.waiters);
    newcomer_charge(): what a context of a process not placed yet reserves (ctxest.Charges);
    over_limit(): "stall" | "kill" (the decider's; a reload may change it);
    quota: the map quotas (quotas.MapQuota); owner: this enforcer's number (control.owner)."""

    def __init__(self, maps, waiters, newcomer_charge, over_limit, quota, owner: int):
        self.maps, self.waiters, self.newcomer_charge, self.over_limit = maps, waiters, newcomer_charge, over_limit
        self.quota, self.owner = quota, owner
        self.exempt = 0              # a self-test child's pid, which admission skips
        self.told = 0                # the waiters count last written to BPF
        self.viewed = -VIEW_GRACE    # last snapshot asked for by a view (`convgpu trace`)

    @property
    def enforcing(self) -> bool:
        return bool(self.maps.leaf.get("enforcing"))

    def write(self, enforcing: bool) -> int:
        """Writes the control map; returns the waiters count BPF knew before."""
        told, self.told = self.told, self.waiters()
        # a context call of a process not placed yet reserves newcomer_charge (placed: its device's
        # estimate); not a GPU's whose context is being measured: its newcomers wait, and are
        # placed asking for the figure measured (ContextCharge.measure_step), and its stand-in
        # figure until then is the conservative one, which would hold a small container's first
        # context for good
        self.maps.write_control(dict(ctx_overhead=self.newcomer_charge(), enforcing=int(enforcing),
                                     exempt=self.exempt, over_limit_kill=int(self.over_limit() == "kill"),
                                     waiters=self.told, owner=self.owner, quiet=int(enforcing and self.quiet()),
                                     **self.quota.leaf()))
        return told

    def rewrite(self):
        """The same switch, fields read again (an estimate or a setting changed)."""
        self.write(self.enforcing)

    def quiet(self) -> bool:
        return time.monotonic() - self.viewed > VIEW_GRACE

    def view(self):
        """A view asked for a snapshot: alloc/free events flow from now until VIEW_GRACE after
        its last one (what came before was not kept)."""
        was_quiet = self.quiet()
        self.viewed = time.monotonic()
        if was_quiet:
            self.write(True)

    @contextlib.contextmanager
    def exempting(self, pid: int):
        """BPF does not admit pid meanwhile: a self-test child that calls every symbol of a
        library just attached (it would stall). Everyone else stays checked: turning admission
        off instead let any process allocate unchecked while the child ran. Admission itself
        stays as it was (off during start-up, until the watchdog runs)."""
        enforcing = self.enforcing
        self.exempt = pid
        self.write(enforcing)
        try:
            yield
        finally:
            self.exempt = 0
            self.write(enforcing)

    def exempt_measuring(self, pid: int, on: bool):
        """The context measurement's child (enforcer/ctxmeasure.py), from its thread."""
        self.maps.set_measuring(pid, on)
