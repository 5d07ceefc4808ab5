"""Who gets what: the policy interface, the policies, node placement, the trace simulator."""
