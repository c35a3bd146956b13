"""What the benchmarks and the tests share: a real platform process on a scratch data directory (harness), OTLP
payloads shaped like real traffic (payloads), a paced load with its memory sampling (load) and the timings the
benchmarks report (timing). Nothing here imports the platform's code: it is driven from outside, as a user's client
would."""
