"""Tests of the networked backends, each against real servers the tests start (one folder each)."""
