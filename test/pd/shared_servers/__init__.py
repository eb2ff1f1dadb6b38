"""Tests sharing one set of real PD servers (``conftest.pd_servers``)."""
