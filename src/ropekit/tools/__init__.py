"""Analysis and measurement tools built on the ropekit core (precision, ...)."""
