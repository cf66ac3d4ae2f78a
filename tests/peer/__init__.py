"""Peer suites: other projects' own tests, ported to run on this repo's CPU/gloo pool, stock and with the plugin on."""
