"""Aspis / Aspis+ over a transport.

- roles: the trusted coordinator and the K workers (and AspisConfig)
"""
