"""`hyatlas`: the admin command line, talking to a running gateway over REST."""
