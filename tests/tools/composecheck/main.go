// composecheck loads compose files with compose-go, the loader inside `docker compose`, and
// prints the resolved project as JSON -- what `docker compose config --format json` prints --
// or the loader's error, with exit status 1. No Docker engine is involved.
//
//	go run . [-profiles gpu,other] compose/docker-compose.yml
//
// Used by tests/test_deploy_static.py: the same schema, interpolation, merge keys, profiles and
// consistency checks (undefined services, volumes, networks) as the real command.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	profiles := flag.String("profiles", "", "comma-separated profiles to enable")
	flag.Parse()
	var enabled []string
	if *profiles != "" {
		enabled = strings.Split(*profiles, ",")
	}
	opts, err := cli.NewProjectOptions(flag.Args(), cli.WithOsEnv, cli.WithDotEnv, cli.WithProfiles(enabled))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}
