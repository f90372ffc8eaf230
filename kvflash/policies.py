"""Names of the residency policies, in a module without torch: the CLI's help lists them before
anything heavy is imported."""

POLICIES = ("qk", "lru", "sink", "full")
