"""Live migration of running decode requests between pdserve instances (see docs/design.md, "Migration")."""
