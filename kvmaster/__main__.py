from kvmaster.cli import main

raise SystemExit(main())
