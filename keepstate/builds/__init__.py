"""Template builds from the SDKs (`Template().from_image(...).run_cmd(...)`, `build(...)`): build steps run in a
sandbox, their layers cached as checkpoints, the result a template (docs/design/template-builds.md). Above
`sandbox`, whose manager runs the build sandbox; the rootfs templates it starts from are `keepstate.template`'s."""
