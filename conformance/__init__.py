"""The conformance suite backend authors run against their own store."""
