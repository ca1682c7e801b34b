def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fuzz_long: the long input-fuzzing profile (run with -m fuzz_long or SHARDPLAN_FUZZ_LONG=1)"
    )
