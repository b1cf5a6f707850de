"""inferd daemon process."""
