"""The one way from the platform to the managed engine fleet: its wiring to this platform, its groups and replicas
as the controller reports them, their metrics, and the control client."""
