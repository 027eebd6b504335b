"""slotmap's conformance suite: a reference scheduler and differential tests any backend can be run against."""
