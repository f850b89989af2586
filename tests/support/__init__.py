"""Helpers the server tests share (not tests themselves): starting servers for a module
(:mod:`support.servers`) and a small JSON-schema checker (:mod:`support.schema`)."""
